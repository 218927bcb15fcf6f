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
# whose gain depends on what is written: "chat" asks for the model's own answers; "edit" gives a
# passage of 50-100 words to correct or rewrite, so that the answer copies most of the prompt
# (where prompt-lookup drafts shine; SmolLM2-135M copies 56-92% of its answer's 3-grams from
# six of the eight, less from the other two); "edit-short" is the first edit set (sentences of
# 10-30 words, some answers not copies), kept so earlier figures can be re-run.
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
        "Correct the spelling mistakes and return the whole text:\n\nThe old lighthouse stood at the edge of the cliff for "
        "more than a hundred yeers. Every nigt, the keeper climbed the narow stairs to light the lamp, and ships far out at "
        "sea used its beam to find there way home. One winter, a terible storm broke the windows and the keeper had to "
        "repair them by hand, working thru the cold nigt until the light shone again.",
        "Rewrite the following text, replacing every 'car' with 'bicycle':\n\nMaria bought a new car last spring. She "
        "rides the car to work every day, and on weekends she takes the car to the mountains. Her friends say the car is "
        "too loud, but Maria loves it. Last week the car broke down, and she had to walk home for two hours.",
        "Fix the punctuation in this text and return all of it:\n\nthe library opens at nine in the morning and closes at "
        "six in the evening visitors can borrow up to five books at a time and keep them for three weeks the reading room "
        "on the second floor is quiet and has large windows that look out over the park children can join the story hour "
        "every saturday morning",
        "Correct the spelling and return the full paragraph:\n\nOur school garden is a wonderfull place. In the spring we "
        "plant tomatos, beans and sunflowers, and in the summer we water them evry morning before class. The younger "
        "students look after the herbs, while the older ones build new beds out of old wood. In the autum we harvest the "
        "vegetables and cook a big soup for the whole school.",
        "Add a comment above each line of this Python code and return the whole code:\n\nimport json\n\n"
        "def load_config(path):\n    with open(path) as f:\n        data = json.load(f)\n"
        "    name = data.get('name', 'default')\n    size = int(data.get('size', 10))\n    return name, size\n",
        "Proofread this email and return it in full:\n\nHi Sarah,\n\nThank you for your message. I am happy to confirm "
        "that the meeting will take place on Tuesday at ten o'clock in the small conference room. Please bring the report "
        "on the new project, and the budget for next year. If you can not come, let me know before Monday so we can find "
        "another time.\n\nBest regards,\nTom",
        "Rewrite this recipe, changing 'sugar' to 'honey' everywhere, and return it:\n\nMix two cups of flour with one cup "
        "of sugar in a large bowl. Add three eggs and a cup of milk, and stir until the batter is smooth. Pour half of the "
        "batter into a pan, sprinkle a spoon of sugar on top, and add the rest of the batter. Bake for forty minutes, then "
        "let the cake cool before you serve it.",
        "Fix the grammar in this story and return the whole story:\n\nThe little fox live in a hole under a big oak tree. "
        "Every evening he go out to look for food, and every morning he come back tired. One day he meet a rabbit who were "
        "lost in the forest. The fox show the rabbit the way home, and since that day the two animals is good friends.",
    ],
    "edit-short": [
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
