"""A Dockerfile's build run here, without Docker: its instructions in order, in a scratch prefix.

    build = DockerfileBuild(dockerfile, context=REPO_ROOT, prefix=tmp_path / "image", build_args={"MODEL": ""})
    build.run()            # every RUN, in order, under /bin/sh -c, with the ARG and ENV values in force, in WORKDIR
    build.output           # what the RUN steps printed; build.env: the image's environment at the end (its
                           # paths as they are here, under the prefix)

What differs from `docker build`, and nothing else:
- the image's file system is `prefix`: an absolute path under /opt, /var or /home that the Dockerfile names (in
  ENV, WORKDIR, COPY, RUN) is that path under `prefix`; other paths (/dev/null, /bin/sh) are this machine's;
- the base image (FROM) is this machine: a plain system PATH, and the tools that need root (apt-get, useradd,
  userdel, chown) are stubs that record their arguments (`build.stub_calls`) and succeed; USER only sets HOME;
- `COPY SRC DEST` copies from the build context what .dockerignore leaves (`!` exceptions are not supported:
  such a file fails the build); other sources (`--from`, URLs) fail the build;
- `after_copy(workdir)` runs after each COPY: where a test puts what a step it cannot run here would have made;
- `extra_env` is added to every RUN's environment (a test's own switches).

A RUN that exits non-zero fails the build (`BuildFailed`), as in Docker. An instruction this runner does not know
fails it too, rather than being skipped.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_ROOTS = ("opt", "var", "home")
ROOT_TOOLS = ("apt-get", "useradd", "userdel", "chown")
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_IMAGE_PATH = re.compile(rf"(?<![\w./$}}-])/(?={'|'.join(IMAGE_ROOTS)}\b)")
_VARIABLE = re.compile(r"\\\$|\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")
_IGNORED = ("EXPOSE", "ENTRYPOINT", "CMD", "LABEL", "STOPSIGNAL", "HEALTHCHECK", "VOLUME")


class BuildFailed(AssertionError):
    """A step failed, as it would fail `docker build`."""


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: line continuations joined, comment lines dropped (also inside a
    continuation, as Docker drops them)."""
    found: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        pending += stripped
        keyword, _, arguments = pending.partition(" ")
        found.append((keyword.upper(), arguments.strip()))
        pending = ""
    if pending:
        raise BuildFailed(f"the Dockerfile ends inside a continued line: {pending!r}")
    return found


def substitute(word: str, env: Mapping[str, str]) -> str:
    """Docker's variable substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR:+alternative}; \\$ is a dollar."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "\\$":
            return "$"
        name = m.group(1) or m.group(4)
        value = env.get(name, "")
        if m.group(2) == "-":
            return value or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if value else ""
        return value

    return _VARIABLE.sub(one, word)


@dataclass
class DockerfileBuild:
    dockerfile: Path
    context: Path
    prefix: Path
    build_args: Mapping[str, str] = field(default_factory=dict)
    extra_env: Mapping[str, str] = field(default_factory=dict)
    after_copy: Callable[[Path], None] | None = None
    step_timeout_s: float = 600.0
    output: str = ""
    env: dict[str, str] = field(default_factory=dict)  # the image's (ENV), as it stands
    args: dict[str, str] = field(default_factory=dict)  # ARG values in force (RUN steps see them, the image not)
    workdir: str = "/"
    base_images: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stubs = self.prefix / ".stub-bin"
        self._stub_log = self.prefix / ".stub-calls"

    def image_path(self, path: str) -> Path:
        """Where an absolute path of the image is here."""
        mapped = self.in_prefix(path)
        if mapped == path:
            raise BuildFailed(f"{path!r} is outside the image roots this runner maps ({', '.join(IMAGE_ROOTS)})")
        return Path(mapped)

    def in_prefix(self, text: str) -> str:
        return _IMAGE_PATH.sub(f"{self.prefix}/", text)

    @property
    def stub_calls(self) -> list[list[str]]:
        if not self._stub_log.exists():
            return []
        return [line.split() for line in self._stub_log.read_text().splitlines()]

    # -- the build --------------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.prefix.mkdir(parents=True, exist_ok=True)
        self._make_stubs()
        self.env = {"PATH": f"{self._stubs}:{BASE_PATH}", "HOME": str(self.prefix / "root")}
        for keyword, arguments in instructions(self.dockerfile.read_text()):
            step = getattr(self, f"_{keyword.lower()}", None)
            if step is not None:
                step(arguments)
            elif keyword not in _IGNORED:
                raise BuildFailed(f"{self.dockerfile.name}: {keyword} is not an instruction this runner knows")

    def _from(self, arguments: str) -> None:
        self.base_images.append(arguments)

    def _arg(self, arguments: str) -> None:
        name, has_default, default = arguments.partition("=")
        value = self.build_args.get(name, substitute(default, self.env | self.args) if has_default else "")
        self.args[name] = value

    def _env(self, arguments: str) -> None:
        words = shlex.split(arguments)
        if words and "=" not in words[0]:  # the old form: ENV NAME value with spaces
            name, _, value = arguments.partition(" ")
            pairs = [(name, value.strip())]
        else:
            pairs = [tuple(w.split("=", 1)) for w in words]  # type: ignore[misc]
        for name, value in pairs:
            self.env[name] = substitute(self.in_prefix(value), self.env | self.args)

    def _workdir(self, arguments: str) -> None:
        path = substitute(arguments, self.env | self.args)
        self.workdir = path if path.startswith("/") else f"{self.workdir.rstrip('/')}/{path}"
        self.image_path(self.workdir).mkdir(parents=True, exist_ok=True)

    def _user(self, arguments: str) -> None:
        user = substitute(arguments, self.env | self.args).split(":")[0]
        self.env["HOME"] = str(self.prefix / ("root" if user == "root" else f"home/{user}"))

    def _copy(self, arguments: str) -> None:
        words = [substitute(w, self.env | self.args) for w in shlex.split(arguments)]
        flags = [w for w in words if w.startswith("--")]
        if [f for f in flags if not f.startswith(("--chown=", "--chmod="))]:
            raise BuildFailed(f"COPY {arguments}: this runner copies from the build context only")
        *sources, dest = [w for w in words if not w.startswith("--")]
        if sources != ["."]:
            raise BuildFailed(f"COPY {arguments}: this runner copies the whole context ('.') only")
        target = dest if dest.startswith("/") else f"{self.workdir.rstrip('/')}/{dest}"
        _copy_context(self.context, self.image_path(target))
        if self.after_copy is not None:
            self.after_copy(self.image_path(target))

    def _run(self, arguments: str) -> None:
        if arguments.startswith("["):  # exec form: no shell
            argv = [self.in_prefix(a) for a in json.loads(arguments)]
        else:
            argv = ["/bin/sh", "-c", self.in_prefix(arguments)]
        env = self.env | self.args | dict(self.extra_env)
        Path(env["HOME"]).mkdir(parents=True, exist_ok=True)
        result = subprocess.run(argv, cwd=self.image_path(self.workdir) if self.workdir != "/" else self.prefix,
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, timeout=self.step_timeout_s)
        self.output += f"--- RUN {arguments}\n{result.stdout}"
        if result.returncode != 0:
            raise BuildFailed(f"RUN {arguments!r} exited {result.returncode}:\n{result.stdout[-6000:]}")

    def _make_stubs(self) -> None:
        self._stubs.mkdir(parents=True, exist_ok=True)
        for tool in ROOT_TOOLS:
            stub = self._stubs / tool
            stub.write_text(f'#!/bin/sh\necho "${{0##*/}} $*" >> "{self._stub_log}"\n')
            stub.chmod(0o755)


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match, plus Docker's `**`: any number of directories)."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _dockerignore(context: Path) -> list[re.Pattern[str]]:
    path = context / ".dockerignore"
    patterns = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!"):
            raise BuildFailed(f".dockerignore: exceptions ({line}) are not supported by this runner")
        patterns.append(_glob_regex(os.path.normpath(line).lstrip("/")))
    return patterns


def _copy_context(context: Path, target: Path) -> None:
    """The build context as `docker build` sends it (less what .dockerignore names), copied into `target`."""
    ignored = _dockerignore(context)

    def excluded(rel: str) -> bool:
        return any(p.fullmatch(rel) for p in ignored)

    target.mkdir(parents=True, exist_ok=True)
    for root, dirs, files in os.walk(context):
        rel_root = os.path.relpath(root, context)
        rel = (lambda name: name) if rel_root == "." else (lambda name: f"{rel_root}/{name}")
        dirs[:] = [d for d in dirs if not excluded(rel(d))]
        for d in list(dirs):
            if (Path(root) / d).is_symlink():  # copied as the link it is, not walked into
                dirs.remove(d)
                files.append(d)
            else:
                (target / rel(d)).mkdir(exist_ok=True)
        for name in files:
            if not excluded(rel(name)):
                shutil.copy2(Path(root) / name, target / rel(name), follow_symlinks=False)
