"""Prompts of the greedy-parity tests (chat-templated and raw: short, long, digits, unicode, code)."""

NUM_NEW_TOKENS = 32

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Compute 1234 + 5678 and explain each step.",
    "Écris une phrase en français sur le café. ☕",
    "Write a haiku about the ocean.",
    "List three prime numbers greater than 100.",
    "こんにちは！元気ですか？",
    "Translate 'good morning' into German, Spanish and Italian.",
]
RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 5, 8, 13, 21,",
    "import numpy as np\n\nx = np.arange(10)\nprint(x",
    "   leading spaces and\ttabs\n\nand blank lines",
    "The year 2024 had 366 days because",
    "Emoji test: 🚀🔥 are popular because",
    "A" * 3,
    ("In the beginning of the twentieth century, physics underwent two revolutions. "
     "The first, relativity, changed our notions of space and time; the second, quantum "
     "mechanics, changed our notion of what can be known about a physical system. Together"),
]
