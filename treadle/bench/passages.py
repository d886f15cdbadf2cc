"""Passages for the ``grounded`` workload (written for Treadle): an input-grounded task asks
the model to repeat or lightly edit a passage it was given, so most of the answer can be
looked up in the prompt (what n-gram speculation exploits)."""
from __future__ import annotations

PASSAGES = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its "
    "lamp turned slowly, sending a long white beam across the water. Fishermen coming home in the dark "
    "looked for that light before anything else, because it told them where the rocks were and where "
    "the harbour began. When the keeper grew too old to climb the stairs, the town voted to keep the "
    "lamp burning with an electric motor, and the keeper moved into a small house at the bottom of the hill.",
    "To make bread at home you need flour, water, salt and yeast. Mix the yeast with warm water and let it "
    "rest for ten minutes. Add the flour and the salt, then knead the dough on a table for about ten "
    "minutes until it feels smooth and elastic. Put it in a bowl, cover it with a cloth and leave it in a "
    "warm place for an hour. When the dough has doubled in size, shape it into a loaf and bake it in a hot "
    "oven for thirty to forty minutes.",
    "The committee met on Tuesday morning to review the budget for the coming year. The treasurer explained "
    "that costs for heating and repairs had risen, while income from membership fees had stayed the same. "
    "After a long discussion, the members agreed to raise the annual fee by a small amount, to postpone "
    "the new roof until the spring, and to ask the city for a grant to cover part of the repairs. The next "
    "meeting will take place on the first Monday of next month.",
    "Rivers shape the land they cross. Over thousands of years, moving water carries sand and stones from "
    "the mountains down to the plains, cutting deep valleys on the way. Where the river slows down, near "
    "the sea, it drops what it carried and builds wide, flat areas of rich soil. Farmers have always "
    "settled on these plains, because the soil is good and water is close, even though floods can destroy "
    "their fields in a single night.",
    "Dear Anna, thank you for your letter and for the photographs of the garden. The roses look wonderful "
    "this year, and I can hardly believe how tall the apple tree has grown. Here in the city the weather has "
    "been grey and wet for weeks, so your pictures made me very happy. I plan to visit you at the end of "
    "the summer, if that suits you, and I will bring the books you asked for. With love, your sister Maria.",
    "A computer program is a list of instructions that a machine follows one after another. Each "
    "instruction is simple: add two numbers, compare two values, move a piece of data from one place to "
    "another. The power of a program comes from combining millions of these simple steps very quickly. "
    "Programmers write instructions in languages that people can read, and special tools translate them "
    "into the numbers that the machine understands.",
)

INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word:\n\n{passage}",
    "Copy the following text, but write every number as digits:\n\n{passage}",
    "Rewrite the following passage exactly as it is, then stop:\n\n{passage}",
)

# the ``chat-text`` workload: everyday assistant questions (written for Treadle; none of them,
# nor their topics, is in benchmarks/prompts/smollm2_chat_train.txt, the draft-head training file)
CHAT_QUESTIONS = (
    "What is the difference between a virus and a bacterium?",
    "Explain how a refrigerator keeps food cold.",
    "Give me three tips for learning a new language.",
    "Why do leaves change colour in autumn?",
    "Write a short thank-you note to a neighbour who watered my plants.",
    "How does a bicycle stay upright when it moves?",
    "What are the main causes of traffic jams in big cities?",
    "Describe how to plant tomatoes in a small garden.",
    "What is a healthy way to prepare for an exam?",
    "Explain what a budget is and why families make one.",
    "How do bees make honey? Keep it short.",
    "Write a short story about a robot who learns to paint.",
)
