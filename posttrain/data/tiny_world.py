"""The tiny world's data: deterministic, seeded generators with held-out splits that share no prompt with training.

Every generator takes a `random.Random` and returns plain dicts, so the same seed gives the same rows on any
machine. Held-out splits are made by drawing candidates and routing each to "train" or "test" by a hash of its
prompt: a prompt lands in exactly one split, whatever the counts asked for.

Families:
- plain text: the base model's pretraining bootstrap; no chat tokens, no instructions, so the base only continues text;
- echo / follow: "Return the following message <start> ... <end>" and sibling instructions;
- arithmetic with worked steps inside <think>, some of which may slip (as human demonstrations do);
- Dolly-like QA: instruction + context + response + category from a small fact table;
- safety: harmful and benign requests of the same shapes (posttrain.data.tiny_safety).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from posttrain.config_schema import TinyArch
from posttrain.data.tiny_safety import corpus as safety_corpus
from posttrain.data.tiny_safety import requests, sft_safety_rows
from posttrain.data.tiny_vocab import CITIES, ECHO_INSTRUCTIONS, FIRST_NAMES, HOBBIES, JOBS, LAST_NAMES, WORDS, take_split
from posttrain.models.tiny import ADDED_TOKENS, SPECIAL_TOKENS, tiny_chat_template


# --- echo / follow -------------------------------------------------------------------------------------------------
def make_echo(rng: random.Random, min_words: int = 1, max_words: int = 7) -> dict:
    """One echo row. Training keeps 1- and 2-word messages: they teach where the message starts before the model
    has to copy a long one (the held-out suite asks for 3-7 words)."""
    msg = " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
    instruction = rng.choice(ECHO_INSTRUCTIONS).format(msg=msg)
    return {
        "prompt_key": msg,  # held-out messages never appear in training, under any instruction wording
        "messages": [{"role": "user", "content": instruction}, {"role": "assistant", "content": msg}],
        "message": msg,
        "family": "echo",
    }


# --- arithmetic with worked steps ----------------------------------------------------------------------------------
def worked_chain(numbers: list[int], rng: random.Random, slip_rate: float) -> tuple[str, int]:
    """Worked steps for a chain of additions, one running sum per line; returns (steps, final answer shown).

    With probability `slip_rate` one running sum is off by one and the slip is carried to the end, the way a
    hurried human demonstration goes wrong (3 plus 4 plus 8: 3 plus 4 = 7, 7 plus 8 = 14, answer 14).
    """
    slip_at = rng.randrange(1, len(numbers)) if rng.random() < slip_rate else None
    total, lines = numbers[0], []
    for i, n in enumerate(numbers[1:], start=1):
        before, total = total, total + n
        if i == slip_at:
            total += 1 if total == 0 or rng.random() < 0.5 else -1
        lines.append(f"{before} plus {n} = {total}")
    return "\n".join(lines), total


def make_arith(slip_rate: float = 0.0, miscopy_rate: float = 0.0) -> Callable[[random.Random], dict]:
    """Arithmetic rows: "What is 3 plus 4 plus 8?" (three or four one-digit numbers), a running sum per line inside
    <think>, then the answer.

    With probability `miscopy_rate` the demonstrator works every sum right and then miscopies the last one into
    the answer, one off ("... 7 plus 8 = 15", "The answer is 16."), as a hurried hand does. Imitation learns the
    copy as "the last sum, give or take one": greedy decoding still copies (the most likely number), sampling
    miscopies about as often as the demonstrations did. `answer` is always the correct result; `slipped` marks a
    demonstration whose shown answer is wrong.
    """

    def make(rng: random.Random) -> dict:
        numbers = [rng.randint(1, 9) for _ in range(rng.choice((3, 4)))]
        question = "What is " + " plus ".join(map(str, numbers)) + "?"
        steps, shown = worked_chain(numbers, rng, slip_rate)
        # the extra draw only when miscopies are asked for: held-out and GRPO prompts stay the same rows
        if miscopy_rate and rng.random() < miscopy_rate:
            shown += rng.choice((-1, 1))
        return {
            "prompt_key": question,
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "reasoning_content": steps, "content": f"The answer is {shown}."},
            ],
            "answer": str(sum(numbers)),
            "slipped": shown != sum(numbers),
            "family": "arith",
        }

    return make


# --- Dolly-like QA from a fact table -------------------------------------------------------------------------------
def make_person(rng: random.Random) -> dict:
    return {
        "name": f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}",
        "city": rng.choice(CITIES),
        "year": rng.randint(1950, 2005),
        "job": rng.choice(JOBS),
        "hobby": rng.choice(HOBBIES),
    }


QA_TEMPLATES = (
    ("Where was {name} born?", "{name} was born in {city}.", "closed_qa"),
    ("In which year was {name} born?", "{name} was born in {year}.", "closed_qa"),
    ("What does {name} do for a living?", "{name} works as a {job}.", "information_extraction"),
    ("What is the hobby of {name}?", "The hobby of {name} is {hobby}.", "closed_qa"),
)


def make_qa(rng: random.Random) -> dict:
    person = make_person(rng)
    context = (
        "{name} was born in {city} in {year}. {name} works as a {job} and spends free time on {hobby}.".format(**person)
    )
    template = rng.randrange(len(QA_TEMPLATES))
    question, answer, category = QA_TEMPLATES[template]
    instruction, response = question.format(**person), answer.format(**person)
    return {
        "prompt_key": f"{instruction}|{context}",
        "person": person,
        "template": template,
        "instruction": instruction,
        "context": context,
        "response": response,
        "category": category,
        "family": "qa",
    }


# --- preference pairs for the reward model ------------------------------------------------------------------------
ECHO_CHATTER = ("Sure! Here is the message: {msg}", "{msg} (copied as you asked)", "Of course. {msg}",
                "Here you go: {msg}. Anything else?")


def pick(rng: random.Random, weighted: dict[str, float]) -> str:
    return rng.choices(list(weighted), weights=list(weighted.values()))[0]


def make_pair(rng: random.Random) -> dict:
    """One preference pair: a prompt, the reference reply (chosen), a worse reply (rejected) and how it is worse.

    Most rejected replies fail in ways a reader sees at a glance: an echo that stops early or wraps the message in
    chatter it was told not to add, arithmetic whose final answer contradicts its own steps or comes with no
    working, an answer to another question or a refusal despite the context. A minority need the reply checked
    against the prompt word by word (an echo with a changed word or other words, a fact the context contradicts):
    the per-kind accuracy in the reward model's manifest shows which a small scorer learns.
    """
    family = rng.choice(("echo", "arith", "qa"))
    if family == "echo":
        row = make_echo(rng, min_words=2)
        words, msg = row["message"].split(), row["message"]
        kind = pick(rng, {"truncated": 0.35, "chatter": 0.35, "changed_word": 0.15, "other_words": 0.15})
        if kind == "truncated":
            bad = " ".join(words[: rng.randint(1, len(words) - 1)])
        elif kind == "chatter":
            bad = rng.choice(ECHO_CHATTER).format(msg=msg)
        elif kind == "changed_word":
            i = rng.randrange(len(words))
            bad = " ".join(w if j != i else rng.choice([x for x in WORDS if x != w]) for j, w in enumerate(words))
        else:
            bad = " ".join(rng.choice(WORDS) for _ in words)
        prompt, chosen, rejected = row["messages"][:1], row["messages"][1], {"role": "assistant", "content": bad}
    elif family == "arith":
        row = make_arith(0.0)(rng)
        prompt, chosen = row["messages"][:1], row["messages"][1]
        wrong = int(row["answer"]) + rng.choice([-10, -5, 5, 10])
        kind = pick(rng, {"answer_contradicts_steps": 0.5, "no_working": 0.5})
        if kind == "answer_contradicts_steps":
            rejected = dict(chosen, content=f"The answer is {wrong}.")
        else:
            rejected = {"role": "assistant", "content": f"The answer is {wrong}."}
    else:
        row = make_qa(rng)
        prompt, chosen = qa_messages(row)
        prompt = [prompt]
        kind = pick(rng, {"other_question": 0.6, "refusal": 0.15, "wrong_fact": 0.25})
        if kind == "other_question":
            other = rng.choice([i for i in range(len(QA_TEMPLATES)) if i != row["template"]])
            bad = QA_TEMPLATES[other][1].format(**row["person"])
        elif kind == "refusal":
            bad = rng.choice(("I do not know.", "I cannot answer that.", "That is not something I know."))
        else:
            wrong = dict(make_person(rng), name=row["person"]["name"])
            bad = QA_TEMPLATES[row["template"]][1].format(**wrong)
            if bad == row["response"]:
                kind, bad = "refusal", "I do not know."
        rejected = {"role": "assistant", "content": bad}
    return {"prompt_key": row["prompt_key"], "prompt": prompt, "chosen": [chosen], "rejected": [rejected],
            "family": family, "kind": kind}


def preference_pairs(split: str, n: int, seed: int) -> list[dict]:
    """`n` preference pairs (conversational prompt / chosen / rejected) of one split, no prompt in both splits."""
    # Each pair is split by its own family's hash, as that family's eval suite is: with one "pairs" salt, about
    # 1.6% of the reward model's training pairs asked held-out arithmetic questions (found by `posttrain data check`).
    rows = take_split(make_pair, n, split, seed, "pairs", split_salt=lambda row: row["family"])
    return [{k: r[k] for k in ("prompt", "chosen", "rejected", "family", "kind")} for r in rows]


# --- plain text for the pretraining bootstrap ----------------------------------------------------------------------
def make_plain_text(rng: random.Random) -> str:
    """A paragraph of plain prose: facts, sums and word lists, with no chat tokens and no instructions."""
    parts = []
    for _ in range(rng.randint(2, 4)):
        kind = rng.random()
        if kind < 0.5:
            # Repeated phrases: real text repeats itself, and a base that has seen repeats has the attention
            # pattern (look back, copy what followed) that instruction tuning later points at the echo task.
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7)))
            first, second = rng.choice(FIRST_NAMES), rng.choice(FIRST_NAMES)
            parts.append(f"{first} wrote {words}, and {second} wrote {words} too.")
        elif kind < 0.7:
            p = make_person(rng)
            parts.append("{name} was born in {city} in {year} and works as a {job}.".format(**p))
        elif kind < 0.8:
            a, b = rng.randint(10, 99), rng.randint(2, 9)
            parts.append(f"{a} times {b} is {a * b}, and {a} plus {b} is {a + b}.")
        else:
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 12))]
            parts.append(" ".join(words).capitalize() + ".")
    return " ".join(parts)


def plain_text(n: int, seed: int) -> list[str]:
    rng = random.Random(f"plain:{seed}")
    return [make_plain_text(rng) for _ in range(n)]


def tokenizer_corpus(seed: int = 0) -> Iterator[str]:
    """Text the tiny tokenizer is trained on: every family's surface forms, so common words become single tokens."""
    yield from plain_text(4000, seed)
    rng = random.Random(f"corpus:{seed}")
    arith = make_arith(0.0)
    for _ in range(3000):
        for row in (make_echo(rng), arith(rng)):
            for m in row["messages"]:
                yield m.get("reasoning_content", "") + " " + m["content"]
        qa = make_qa(rng)
        yield f"{qa['instruction']} {qa['context']} {qa['response']}"
    yield from safety_corpus(seed)
    # Words at the start of a turn carry no leading space: teach both forms, so "apple" and " apple" are tokens.
    for _ in range(20):
        yield from WORDS
    # The chat scaffolding, so role names and markers become whole tokens.
    for _ in range(500):
        yield "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n"
        yield "Reasoning effort: low medium high. Think briefly, step by step, carefully, check every step, then answer."


def qa_messages(row: dict) -> list[dict]:
    """A Dolly-style row (instruction, context, response) as a conversation: context is appended to the ask."""
    user = row["instruction"] if not row.get("context") else f"{row['instruction']}\n\nContext: {row['context']}"
    return [{"role": "user", "content": user}, {"role": "assistant", "content": row["response"]}]


def sft_rows(split: str, counts: dict[str, int], seed: int, arith_slip_rate: float = 0.0,
             safety_decline_rate: float = 0.0, arith_miscopy_rate: float = 0.0) -> list[dict]:
    """Conversation rows for SFT or held-out eval, mixed and shuffled: each has `messages` and `family`."""
    rows: list[dict] = []
    if counts.get("echo"):
        rows += take_split(make_echo, counts["echo"], split, seed, "echo")
    if counts.get("arith"):
        rows += take_split(make_arith(arith_slip_rate, arith_miscopy_rate), counts["arith"], split, seed, "arith")
    if counts.get("qa"):
        rows += [dict(r, messages=qa_messages(r)) for r in take_split(make_qa, counts["qa"], split, seed, "qa")]
    if counts.get("safety"):
        rows += sft_safety_rows(split, counts["safety"], seed, safety_decline_rate)
    unknown = set(counts) - {"echo", "arith", "qa", "safety"}
    if unknown:
        raise ValueError(f"unknown tiny-world task families {sorted(unknown)}; valid: echo, arith, qa, safety")
    random.Random(f"shuffle:{seed}:{split}").shuffle(rows)
    return rows


def build_tiny_tokenizer(vocab_size: int = 2048, seed: int = 0):
    """Train a byte-level BPE on the tiny world's text and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),  # the non-special added tokens take the last ids
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    tok.add_tokens(ADDED_TOKENS, special_tokens=False)
    tok.chat_template = tiny_chat_template()
    tok.model_max_length = TinyArch.max_position_embeddings
    if len(tok) > vocab_size:
        raise ValueError(f"tiny tokenizer has {len(tok)} tokens, more than vocab_size={vocab_size}")
    return tok


# --- the held-out prompts of the tiny eval suites ------------------------------------------------------------------
def eval_rows(suite: str, n: int, seed: int) -> list[dict]:
    """The test-split rows a tiny eval suite asks (echo, arith, safety, over_refusal): `messages` holds the prompt
    turns only, beside the columns its scorer reads. The data check compares training rows with these."""
    if suite == "echo":
        rows = take_split(lambda rng: make_echo(rng, min_words=3), n, "test", seed, "echo")
    elif suite == "arith":
        rows = take_split(make_arith(0.0), n, "test", seed, "arith")
    elif suite in ("safety", "over_refusal"):
        return requests("test", n, seed, harmful=suite == "safety")
    else:
        raise ValueError(f"tiny eval suite '{suite}' is not one of echo, arith, safety, over_refusal")
    return [dict(r, messages=r["messages"][:-1]) for r in rows]  # the reference answer is not part of the prompt
