"""Reading a `TokenizerSpec` out of a Hugging Face model directory.

Files, all but the first optional:

    tokenizer.json          model (BPE: vocab, merges, ignore_merges), added_tokens, normalizer,
                            pre_tokenizer, post_processor (which special ids encode() adds)
    tokenizer_config.json   chat_template, bos_token / eos_token, add_bos_token / add_eos_token (override the
                            post_processor, as transformers' Llama-style tokenizers do)
    chat_template.jinja     the chat template, when saved apart (newer transformers); wins over the config's
    special_tokens_map.json bos_token / eos_token when tokenizer_config.json lacks them
    generation_config.json  eos_token_id (an int or a list): more ids that end generation

Only byte-level BPE is supported: the pre-tokenizer must contain ByteLevel. Every structure we do not
understand is refused with a ValueError naming it, rather than silently tokenizing differently from HF.
"""

from __future__ import annotations

import json
import os
from typing import Any

import regex

from engine.tokenizer.bpe import NORMALIZATION_FORMS, AddedToken
from engine.tokenizer.pre_tokenizer import DIGIT_RUN_PATTERN, GPT2_PATTERN, SINGLE_DIGIT_PATTERN
from engine.tokenizer.spec import TokenizerSpec

def spec_from_hf_dir(path: str | os.PathLike[str]) -> TokenizerSpec:
    directory = os.fspath(path)
    tokenizer_json = _read_json(directory, "tokenizer.json", required=True)
    config = _read_json(directory, "tokenizer_config.json")
    model = tokenizer_json.get("model") or {}
    where = os.path.join(directory, "tokenizer.json")
    if model.get("type") != "BPE":
        raise ValueError(f"{where}: model type is {model.get('type')!r}; only byte-level 'BPE' is supported")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise ValueError(f"{where}: continuing_subword_prefix/end_of_word_suffix are not supported")

    vocab: dict[str, int] = dict(model["vocab"])
    added_tokens = tuple(
        AddedToken(
            content=entry["content"],
            id=int(entry["id"]),
            special=bool(entry.get("special", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
        )
        for entry in tokenizer_json.get("added_tokens") or ()
    )
    token_ids = dict(vocab)
    token_ids.update((token.content, token.id) for token in added_tokens)

    stages: list[str] = []
    if not _collect_stages(tokenizer_json.get("pre_tokenizer"), stages, where):
        raise ValueError(f"{where}: the pre-tokenizer has no ByteLevel step; only byte-level BPE is supported")

    special_tokens = _read_json(directory, "special_tokens_map.json")
    bos_id = _token_id(config.get("bos_token", special_tokens.get("bos_token")), token_ids)
    eos_id = _token_id(config.get("eos_token", special_tokens.get("eos_token")), token_ids)
    prefix, suffix = _template_ids(tokenizer_json.get("post_processor"), where)
    # transformers rebuilds the post-processor from these flags when the config sets them.
    if isinstance(config.get("add_bos_token"), bool):
        prefix = (bos_id,) if config["add_bos_token"] and bos_id is not None else ()
    if isinstance(config.get("add_eos_token"), bool):
        suffix = (eos_id,) if config["add_eos_token"] and eos_id is not None else ()

    generation = _read_json(directory, "generation_config.json")
    generation_eos = generation.get("eos_token_id")
    eos_list = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    extra_eos = tuple(dict.fromkeys(int(i) for i in eos_list if i is not None and i != eos_id))
    if eos_id is None and extra_eos:
        eos_id, extra_eos = extra_eos[0], extra_eos[1:]

    unk_token = model.get("unk_token")
    return TokenizerSpec(
        vocab=vocab,
        merges=tuple(_parse_merge(merge, where) for merge in model.get("merges") or ()),
        pre_tokenizer_stages=tuple(stages),
        added_tokens=added_tokens,
        normalization=_normalization(tokenizer_json.get("normalizer"), where),
        ignore_merges=bool(model.get("ignore_merges", False)),
        unk_token_id=token_ids.get(unk_token) if unk_token is not None else None,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        extra_eos_token_ids=extra_eos,
        prefix_token_ids=prefix,
        suffix_token_ids=suffix,
        chat_template=_chat_template(directory, config),
        source=directory,
    )


def _read_json(directory: str, name: str, required: bool = False) -> dict[str, Any]:
    file_path = os.path.join(directory, name)
    if not os.path.exists(file_path):
        if required:
            raise FileNotFoundError(f"{directory}: no {name}")
        return {}
    with open(file_path, encoding="utf-8") as file:
        loaded = json.load(file)
    return loaded if isinstance(loaded, dict) else {}


def _parse_merge(merge: str | list[str], where: str) -> tuple[str, str]:
    """Merges come as "a b" (older files) or ["a", "b"] (tokenizers >= 0.20, which allows spaces in tokens)."""
    if isinstance(merge, str):
        first, space, second = merge.partition(" ")
        if space:
            return first, second
    elif len(merge) == 2:
        return merge[0], merge[1]
    raise ValueError(f"{where}: malformed merge {merge!r}")


def _collect_stages(node: dict[str, Any] | None, stages: list[str], where: str) -> bool:
    """Append the regex stages of a pre-tokenizer node to `stages`; True when a ByteLevel step was seen."""
    if node is None:
        return False
    kind = node.get("type")
    if kind == "Sequence":
        seen = [_collect_stages(child, stages, where) for child in node.get("pretokenizers", ())]
        return any(seen)
    if kind == "ByteLevel":
        if node.get("add_prefix_space", False):
            raise ValueError(f"{where}: ByteLevel(add_prefix_space=True) is not supported")
        if node.get("use_regex", True):
            stages.append(GPT2_PATTERN)
        return True
    if kind == "Digits":
        stages.append(SINGLE_DIGIT_PATTERN if node.get("individual_digits", False) else DIGIT_RUN_PATTERN)
        return False
    if kind == "Split":
        behavior = str(node.get("behavior", "")).lower()
        if behavior != "isolated" or node.get("invert", False):
            raise ValueError(f"{where}: Split pre-tokenizer with behavior {node.get('behavior')!r} is not supported")
        pattern = node.get("pattern") or {}
        if "Regex" in pattern:
            stages.append(pattern["Regex"])
        elif "String" in pattern:
            stages.append(regex.escape(pattern["String"]))
        else:
            raise ValueError(f"{where}: Split pre-tokenizer pattern {pattern!r} is not understood")
        return False
    raise ValueError(f"{where}: pre-tokenizer {kind!r} is not supported")


def _normalization(node: dict[str, Any] | None, where: str) -> str | None:
    if node is None:
        return None
    kind = node.get("type")
    if kind == "Sequence" and not node.get("normalizers"):
        return None
    if kind in NORMALIZATION_FORMS:
        return str(kind)
    raise ValueError(f"{where}: normalizer {kind!r} is not supported (only {', '.join(NORMALIZATION_FORMS)})")


def _template_ids(node: dict[str, Any] | None, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefix, suffix) special ids that a TemplateProcessing puts around a single sequence."""
    if node is None or node.get("type") == "ByteLevel":  # ByteLevel post-processing only trims offsets
        return (), ()
    kind = node.get("type")
    if kind == "Sequence":
        prefix: tuple[int, ...] = ()
        suffix: tuple[int, ...] = ()
        for child in node.get("processors", ()):
            child_prefix, child_suffix = _template_ids(child, where)
            prefix, suffix = child_prefix + prefix, suffix + child_suffix
        return prefix, suffix
    if kind != "TemplateProcessing":
        raise ValueError(f"{where}: post-processor {kind!r} is not supported")
    special = node.get("special_tokens") or {}
    prefix_ids: list[int] = []
    suffix_ids: list[int] = []
    seen_sequence = False
    for piece in node.get("single") or ():
        if "Sequence" in piece:
            seen_sequence = True
        elif "SpecialToken" in piece:
            name = piece["SpecialToken"]["id"]
            ids = [int(i) for i in special[name]["ids"]]
            (suffix_ids if seen_sequence else prefix_ids).extend(ids)
    return tuple(prefix_ids), tuple(suffix_ids)


def _token_id(token: str | dict[str, Any] | None, token_ids: dict[str, int]) -> int | None:
    """A config's token entry is a string or a serialized AddedToken ({"content": ...})."""
    if isinstance(token, dict):
        token = token.get("content")
    return token_ids.get(token) if isinstance(token, str) else None


def _chat_template(directory: str, config: dict[str, Any]) -> str | None:
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as file:
            return file.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
