"""Texts every tokenizer comparison runs on, and a synthetic byte-level BPE model directory to compare against.

The synthetic models are trained in-test with HF `tokenizers`, in the shapes real models ship: SmolLM's
Digits+ByteLevel, GPT-2's plain ByteLevel with a BOS post-processor, Llama-3's Split regex with ignore_merges,
and Qwen2's NFC + Split regex.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

from engine.tokenizer.pre_tokenizer import LLAMA3_PATTERN, QWEN2_PATTERN

CORPUS: list[str] = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've WE'RE IT'S done",
    "Numbers: 12345 and 3.14159, 1,000,000 or -42e10; v2.0.1",
    "x  1",
    "1 2  3   4\n\n\n5",
    "def add(a, b):\n    return a + b  # sum\n\n\tif x == 0:\n\t\tpass\n",
    'print(f"{name!r:>10}") // <div class="x">&amp;</div>',
    "    leading spaces and trailing   ",
    "line one\nline two\r\nline three\n\n\n",
    "日本語のテキストと中文文本",
    "Emoji: 😀👍🏽🇯🇵 and ZWJ 👩‍👩‍👧 family",
    "Ünïcödé café naïve façade Straße Ελληνικά русский",
    "combining e\u0301 vs \u00e9 and \ufb01 ligature",
    "\u00a0non-breaking\u3000ideographic space\u2009thin",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text with<|im_end|>special in the middle<|endoftext|>end",
    "<|im_start|><|im_start|> doubled and <|im_start broken",
    "tags: <think>reasoning</think> done",
    "fill in the   <mask> please",
    "a" * 50 + " " + "ab" * 20,
    "\t\t\n  \n",
]

TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. Serving language models needs careful scheduling of prefill and "
    "decode work, caching of key-value blocks, and streaming of tokens. "
    "def main():\n    for i in range(10):\n        print(i, i * 2)\n    return 0\n"
    "In 2024 the price was 3.14159 dollars, up 12345 percent. "
    "日本語のテキストです。中文文本。Emoji 😀👍 are fun. Ünïcödé café naïve. "
    "I'm sure you'll see they've done it. Hello world! Hello there, world.\n\n"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}\n"
    "<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% endif %}"
)

VARIANTS = ["smollm", "gpt2-bos", "llama3", "qwen2"]


def train_tokenizer(variant: str) -> Tokenizer:
    """A small byte-level BPE (about 700 tokens) in the shape of one real model family."""
    tokenizer = Tokenizer(models.BPE(ignore_merges=variant == "llama3"))
    byte_level_split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if variant == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif variant == "gpt2-bos":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif variant == "llama3":
        split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level_split])
    elif variant == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level_split])
    else:
        raise ValueError(variant)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TRAINING_TEXT] * 3 + CORPUS, trainer)
    tokenizer.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    bos = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    if variant == "gpt2-bos":
        tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False)])
        tokenizer.post_processor = bos
    elif variant == "llama3":
        tokenizer.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), bos])
    return tokenizer


def write_hf_dir(tokenizer: Tokenizer, variant: str, directory: Path) -> Path:
    """tokenizer.json + tokenizer_config.json (+ generation_config.json for one variant) in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if variant == "smollm":
        # Older files spell merges "a b"; check that form too.
        data = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        data["model"]["merges"] = [" ".join(pair) for pair in data["model"]["merges"]]
        (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        # Older configs serialize a token as an AddedToken dict; check that form too.
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if variant == "qwen2":
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}), encoding="utf-8")
    return directory
