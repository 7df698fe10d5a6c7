"""Varied prompts for distillation, produced here from templates and word lists (no outside data
set, and never the benchmark's prompts). Categories cover the kinds of requests a chat model
gets: writing, roleplay, reasoning, math, coding, extraction, science, humanities, translation,
summarization, question answering and documents to read. Prompts that need a passage
(summarize, extract, answer from a document) get one written by the target itself first."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from ..errors import PromptFileError

TOPICS = """photosynthesis|the water cycle|black holes|plate tectonics|the immune system|volcanoes|
climate change|the French Revolution|the Roman Empire|the printing press|the industrial revolution|
ancient Egypt|the Silk Road|the moon landing|the internet|artificial intelligence|electric cars|
solar power|wind turbines|honeybees|coral reefs|the Amazon rainforest|deserts|glaciers|
earthquakes|hurricanes|the human heart|sleep|nutrition|exercise|meditation|coffee|tea|chocolate|
bread baking|gardening|composting|urban planning|public libraries|museums|jazz|classical music|
the guitar|photography|chess|football|the Olympic Games|marathon running|mountain climbing|
sailing|trains|airplanes|bicycles|bridges|skyscrapers|the Great Wall of China|pyramids|
democracy|taxes|inflation|supply and demand|small businesses|remote work|time management|
public speaking|learning a language|memory|habits|friendship|kindness|curiosity|dinosaurs|
evolution|DNA|vaccines|antibiotics|the solar system|Mars|comets|telescopes|microscopes|
magnets|electricity|batteries|recycling|plastic pollution|clean water|forests|wolves|
elephants|octopuses|owls|penguins|dolphins|ants|spiders|butterflies|mushrooms|volunteering|
board games|video games|movies|poetry|novels|fairy tales|mythology|the Renaissance|
Shakespeare|Leonardo da Vinci|Marie Curie|Isaac Newton|Albert Einstein|cryptography|
databases|operating systems|compilers|open source software|smartphones|social media|privacy|
online shopping|budgeting|saving money|cooking rice|pizza|street food|travel|Japan|Brazil|
Kenya|Norway|India|Mexico|Italy|Canada|Egypt|Australia""".replace("\n", "").split("|")

THINGS = """tips for better sleep|uses of baking soda|benefits of walking|
ways to save energy at home|reasons to learn history|fruits rich in vitamin C|
famous inventors|programming languages|
board games for families|habits of productive people|ways to reduce stress|rivers in Europe|
musical instruments|kinds of clouds|mammals that live in the ocean|ideas for a rainy day|
questions to ask in a job interview|things to pack for a beach trip|ways to stay hydrated|
classic novels|healthy breakfast ideas|houseplants that are easy to care for""".replace(
    "\n", "").split("|")

LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
SENTENCES = [
    "The weather is lovely today.", "Where is the nearest train station?",
    "I would like a cup of coffee, please.", "My brother works as a doctor in the city.",
    "We are going to the beach tomorrow.", "Could you help me carry these boxes?",
    "The museum opens at nine in the morning.", "She reads a book every week.",
    "How much does this jacket cost?", "Thank you for your kind message.",
    "The children are playing in the garden.", "I forgot my umbrella at home.",
    "Our meeting starts in ten minutes.", "This restaurant serves the best soup in town.",
]

CODE_TASKS = """reverses a string|checks whether a number is prime|returns the n-th Fibonacci
number|counts the vowels in a sentence|merges two sorted lists|removes duplicates from a list
while keeping order|computes the factorial of a number|finds the largest element in a list|
checks whether a word is a palindrome|converts Celsius to Fahrenheit|flattens a nested list|
counts word frequencies in a text|implements binary search|validates an email address with a
simple rule|sorts a list of dictionaries by a key|reads a CSV file and sums a column|computes
the greatest common divisor of two numbers|generates all permutations of a list|implements a
stack class|implements a queue with two stacks""".replace("\n", " ").split("|")
CODE_LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "Rust", "Go", "Java"]

ROLES = """a friendly pirate captain|a tour guide in Rome|a medieval knight|a detective in
1920s London|a wise old librarian|a spaceship engineer|a nervous first-day intern|a cheerful
chef|a park ranger|a time traveler from the year 3000|a famous painter|a sports coach""".replace(
    "\n", " ").split("|")

NAMES = ["Alice", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas",
         "Kemi", "Liam", "Mara", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["apples", "pencils", "books", "marbles", "cookies", "stickers", "tickets", "coins"]


@dataclass(frozen=True)
class PromptSpec:
    category: str
    text: str  # for categories that need a passage, contains "{passage}"
    passage_request: str = ""  # what to ask the target to write as the passage
    follow_up: str = ""  # a second user turn, answered after the first reply


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    return rng.choice([
        f"Solve for x: {c}x + {a} = {a + c * b}. Show your steps.",
        f"What is {a} multiplied by {b}? Explain how you got it.",
        f"{name} has {a} {item} and gives {b % a + 1} to {other}. How many are left?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"What is {c * 5}% of {a * 10}?",
        f"A train travels {a * 10} km in {c} hours. What is its average speed?",
        f"Is {a * b + 1} a prime number? Explain your reasoning.",
        f"Simplify the fraction {a * c}/{b * c}.",
    ])


def make_prompts(n: int, seed: int = 0) -> list[PromptSpec]:
    rng = random.Random(seed)
    topic = lambda: rng.choice(TOPICS)  # noqa: E731
    makers = {
        "writing": lambda: rng.choice([
            f"Write a short blog post about {topic()}.",
            f"Write a poem about {topic()}.",
            f"Write a short story that involves {topic()}.",
            f"Write a persuasive paragraph about why people should care about {topic()}.",
            f"Write a product description for a gadget related to {topic()}.",
            f"Write an email to a friend telling them about {topic()}.",
        ]),
        "roleplay": lambda: f"Pretend you are {rng.choice(ROLES)}. " + rng.choice([
            "Introduce yourself.", "Describe your day.", f"Tell me about {topic()}.",
            "Give me some advice."]),
        "reasoning": lambda: rng.choice([
            f"What would happen if {topic()} suddenly disappeared? Think it through.",
            f"Compare {topic()} and {topic()}: how are they alike and different?",
            f"{rng.choice(NAMES)} is taller than {rng.choice(NAMES[:10])}, who is taller than "
            f"{rng.choice(NAMES[10:])}. Who is the shortest? Explain.",
            f"Give three arguments for and three against {topic()}.",
        ]),
        "math": lambda: _math(rng),
        "coding": lambda: (f"Write a {rng.choice(CODE_LANGUAGES)} function that "
                           f"{rng.choice(CODE_TASKS)}."),
        "stem": lambda: rng.choice([
            f"Explain how {topic()} works.", f"What is the science behind {topic()}?",
            f"Explain {topic()} to a high school student.",
        ]),
        "humanities": lambda: rng.choice([
            f"What is the history of {topic()}?",
            f"Why is {topic()} important to society?",
            f"Describe the cultural significance of {topic()}.",
        ]),
        "translation": lambda: (f"Translate into {rng.choice(LANGUAGES)}: "
                                f"\"{rng.choice(SENTENCES)}\""),
        "qa": lambda: rng.choice([
            f"What is {topic()}?", f"Who first studied {topic()}?",
            f"List five {rng.choice(THINGS)}.", f"Give me some {rng.choice(THINGS)}.",
            f"What are common misconceptions about {topic()}?",
        ]),
    }
    passage_tasks = {
        "summarization": "Summarize the following text in a few sentences.\n\n{passage}",
        "extraction": "Extract the key facts from the text below as a bulleted list.\n\n{passage}",
        "rag": "Read the document and answer the question.\n\nDocument:\n{passage}\n\n"
               "Question: What is the main point of the document?",
    }
    follow_ups = ["Can you make it shorter?", "Explain that in simpler words.",
                  "Give me one more example.", "What is the most important part?",
                  "Now write it as a list."]
    categories = list(makers) + list(passage_tasks)
    out = []
    for _ in range(n):
        category = rng.choice(categories)
        follow = rng.choice(follow_ups) if rng.random() < 0.15 else ""
        if category in passage_tasks:
            out.append(PromptSpec(category, passage_tasks[category],
                                  f"Write two detailed paragraphs about {topic()}.", follow))
        else:
            out.append(PromptSpec(category, makers[category](), follow_up=follow))
    return out


def prompts_from_file(path: Path) -> list[PromptSpec]:
    """A prompt file for `distill --prompts FILE`: one prompt a line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{path}: cannot read the prompt file ({e})") from e
    specs = [PromptSpec("user", line.strip()) for line in lines if line.strip()]
    if not specs:
        raise PromptFileError(f"{path}: no prompts in it (one a line)")
    return specs
