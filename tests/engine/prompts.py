"""A varied prompt set for exactness tests: short, long (> 1,000 tokens), chat-templated, mixed lengths."""

from __future__ import annotations

SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers: 2, 3,",
    "Translate to French: I love reading books.",
    "1, 1, 2, 3, 5, 8, 13,",
    "The quick brown fox",
    "Q: What is 12 times 12?\nA:",
    "import numpy as np\nx = np.",
    "Water boils at",
]

CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Give me a short tip for learning Python."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a color."},
    ],
]

_TOPICS = [
    "the history of the printing press and how it changed the spread of ideas in Europe",
    "how photosynthesis converts sunlight, water and carbon dioxide into sugar and oxygen",
    "the design of suspension bridges and the forces acting on their cables",
    "why the sky appears blue during the day and red at sunset",
    "the rules of chess and how the pieces move across the board",
    "the water cycle, from evaporation over the oceans to rain on the mountains",
    "how a compiler turns source code into machine instructions",
    "the migration of birds across continents each autumn and spring",
]


def long_prompt(min_words: int = 900) -> str:
    """A > 1,000-token document: numbered paragraphs on varied topics, ending in a question."""
    parts: list[str] = []
    i = 0
    while sum(len(p.split()) for p in parts) < min_words:
        topic = _TOPICS[i % len(_TOPICS)]
        parts.append(
            f"Section {i + 1}. This section describes {topic}. Scholars have written about {topic} for many "
            f"years, and each generation adds new details, new measurements and new questions. In section "
            f"{i + 1} we summarise what is known, what remains uncertain, and why it matters to everyday life."
        )
        i += 1
    return "\n\n".join(parts) + "\n\nQuestion: which section talks about chess? Answer: Section"
