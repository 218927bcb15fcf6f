"""The standard benchmark workloads (shared/WORKLOADS.md): random token-id prompts, greedy, EOS ignored."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    num_prompts: int
    input_len: int
    output_len: int

    def prompts(self) -> list[list[int]]:
        rng = np.random.default_rng(seed=self.seed)
        return rng.integers(1000, 40000, size=(self.num_prompts, self.input_len)).tolist()


WORKLOADS = {
    "W1": Workload("W1", seed=0, num_prompts=64, input_len=256, output_len=128),
    "W2": Workload("W2", seed=1, num_prompts=1, input_len=128, output_len=128),
    "W3": Workload("W3", seed=0, num_prompts=256, input_len=256, output_len=128),
}


# Text prompts (sent through the chat template, answers end at EOS) for speculative decoding,
# whose gain depends on what is written: "chat" asks for the model's own answers, "edit" for
# answers that copy most of the prompt (where n-gram drafts shine).
TEXT_PROMPTS = {
    "chat": [
        "What are three good habits for staying healthy?",
        "Explain what a hash table is in simple terms.",
        "Write a short poem about the moon.",
        "How do I make a cup of tea?",
        "Give me a list of five fruits and their colors.",
        "What is the difference between weather and climate?",
        "Write a Python function that checks whether a number is prime.",
        "Summarize the plot of Romeo and Juliet in a few sentences.",
    ],
    "edit": [
        "Correct the spelling mistakes and return the whole text: The qick brown fox jumpd over the lazy dog. "
        "It ran accross the feild and into the forrest, where it found a small strem of clear water.",
        "Rewrite this list in alphabetical order: banana, apple, cherry, mango, kiwi, grape, orange, lemon, peach, pear.",
        "Fix the grammar and return the full paragraph: She go to the market every mornings. She buy apples and "
        "bread, and then she walk home slowly because the bag are heavy.",
        "Repeat this code exactly, adding a docstring to the function:\ndef area(width, height):\n"
        "    result = width * height\n    return result",
        "Change every 'cat' to 'dog' in this text and return it: The cat sat by the window. The cat watched the "
        "birds. When the cat got hungry, the cat walked to the kitchen.",
        "Convert this sentence to uppercase: the meeting starts at nine o'clock in the main hall on the second floor.",
    ],
}


# The greedy-parity prompts: short, long, raw and chat (their sentences are made up).
_FACTS = [
    "The river flows north through the valley before it reaches the old stone bridge.",
    "In 1887 the town council voted to build a library with money from the railway company.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and warm milk.",
    "Mount Kilimanjaro is the highest mountain in Africa and a dormant volcano.",
    "The committee postponed its decision until the engineers had finished the survey.",
]


def parity_prompts(tok) -> list[list[int]]:
    """The parity prompts (tests/test_parity.py and the accuracy benchmarks): ten diverse
    prompts as token ids, raw and chat-formatted, 1 to ~1,500 tokens."""

    def long_text(n: int) -> str:
        return " ".join(f"({i}) {_FACTS[i % len(_FACTS)]}" for i in range(n))

    def chat(msgs):
        return tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)

    raw = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,",
           long_text(20) + "\nSummary:", long_text(75) + "\nQuestion: what did the council vote for?\nAnswer:"]  # fmt: skip
    out = [[tok.encode("Hello")[0]]] + [tok.encode(t) for t in raw]
    out.append(chat([{"role": "user", "content": "What is the capital of France?"}]))
    out.append(chat([{"role": "user", "content": "Write a haiku about autumn leaves."}]))
    out.append(chat([{"role": "system", "content": "You are a terse assistant."},
                     {"role": "user", "content": "List three prime numbers."},
                     {"role": "assistant", "content": "2, 3, 5."},
                     {"role": "user", "content": "Three more, please."}]))  # fmt: skip
    out.append(chat([{"role": "user", "content": "Summarize this text:\n" + long_text(40)}]))
    return out
