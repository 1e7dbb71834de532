"""Variable tracking (RULER ``vt``): follow a chain of assignments hidden in the noise haystack.

A chain is "VAR ABCDE = 12345." then "VAR FGHIJ = VAR ABCDE." and so on; the answer is every
variable that ends up holding the value. A 135M model rarely solves it in free generation, but the
teacher-forced gold NLL and KL still separate policies (see the reference notes), which is why it is
in the suite.
"""

from __future__ import annotations

import random
import string

from kvlab.tasks.prompt import Encoder, TaskError, TaskItem, assemble, check_depth
from kvlab.tasks.words import NOISE_LINE


def random_names(rng: random.Random, n: int, letters: int = 5) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(letters))
        if name not in names:
            names.append(name)
    return names


def chain_statements(names: list[str], value: str) -> list[str]:
    first = [f"VAR {names[0]} = {value}."]
    return first + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)]


def variable_tracking(enc: Encoder, *, length: int, depth: float, sample: int, seed: int,
                      num_hops: int = 4, num_chains: int = 1, max_new_tokens: int = 30) -> TaskItem:
    """The queried chain starts at ``depth`` and its hops follow at random later lines; other
    chains (``num_chains - 1``, with other values) are spread over the whole haystack."""
    rng = random.Random(seed)
    depth = check_depth(depth)
    if int(num_hops) < 1 or int(num_chains) < 1:
        raise TaskError(f"num_hops={num_hops}, num_chains={num_chains}: use at least 1 of each")
    num_hops, num_chains = int(num_hops), int(num_chains)
    names = random_names(rng, (num_hops + 1) * num_chains)
    values: list[str] = []
    while len(values) < num_chains:
        v = str(rng.randint(10000, 99999))
        if v not in values:
            values.append(v)
    needles: list[tuple[float, str]] = []
    chains = [names[c * (num_hops + 1):(c + 1) * (num_hops + 1)] for c in range(num_chains)]
    for c, (chain, value) in enumerate(zip(chains, values, strict=True)):
        if c == 0:
            depths = [depth] + sorted(depth + (1 - depth) * rng.random() for _ in range(num_hops))
        else:
            depths = sorted(rng.random() for _ in range(num_hops + 1))
        needles += list(zip(depths, chain_statements(chain, value), strict=True))
    target, value = chains[0], values[0]
    n_vars = num_hops + 1
    return assemble(
        enc, task="variable_tracking", length=length, depth=depth, sample=sample, seed=seed,
        instruction="Memorize and track the chain(s) of variable assignments hidden in the following text.",
        filler_line=NOISE_LINE, needles=needles,
        question=f"Question: Find all variables that are assigned the value {value} in the text above.",
        answer_prefix=(f"Answer: According to the chain(s) of variable assignments in the text above, "
                       f"{n_vars} variables are assigned the value {value}, they are:"),
        answer_text=" " + " ".join(target), references=target, metric="string_match_all",
        max_new_tokens=max_new_tokens, meta={"chain": target},
    )
