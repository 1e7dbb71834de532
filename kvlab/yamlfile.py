"""YAML that kvlab reads from users (params files, ``--set`` values, ``--ctx-dist``), bounded and
strict: a key given twice in one mapping is refused (PyYAML would keep the last one without a word),
and a text is refused before it is expanded when it is longer than :data:`MAX_YAML_BYTES` or when
its aliases expand past :data:`MAX_YAML_VALUES` values (a "billion laughs" file would otherwise hang
whatever walks the result). Every refusal is one line naming the limit and the fix.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvlab.errors import UserError

MAX_YAML_BYTES = 1_000_000  # a params file is a few hundred bytes; long length lists belong in ctx: {file: ...}
MAX_YAML_VALUES = 100_000  # scalars, lists and mappings, counted with every alias expanded

_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: a 1 MB text in milliseconds


class YamlError(UserError):
    """A YAML text that is invalid, too large, or ambiguous (a duplicate key)."""


class _StrictLoader(_BASE_LOADER):  # type: ignore[misc,valid-type]
    """A safe loader whose mappings refuse a key given twice."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: the base constructor says so
                    continue
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key, first: int, again: int):
        super().__init__(key, first, again)
        self.key, self.first, self.again = key, first, again


def expanded_size(node, limit: int) -> int:
    """How many values ``node`` holds with every alias expanded, counting up to just past ``limit``
    (shared nodes are sized once and added per use, so a bomb is measured without being expanded)."""
    sizes: dict[int, int] = {}

    def size(n, depth: int = 0) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if depth > 200:
            return limit + 1  # nesting this deep is no params file
        total = 1
        if isinstance(n, yaml.SequenceNode):
            children = n.value
        elif isinstance(n, yaml.MappingNode):
            children = [c for pair in n.value for c in pair]
        else:
            children = []
        for child in children:
            total += size(child, depth + 1)
            if total > limit:
                break
        sizes[id(n)] = total = min(total, limit + 1)
        return total

    return size(node) if node is not None else 0


def load_yaml(text: str, where: str, error: type[UserError] = YamlError) -> Any:
    """Parse ``text`` (``where`` names it in messages: ``params file p.yaml``, ``--set 'ctx=...'``)
    into Python values, or raise one ``error`` line: invalid YAML (with line and column), too long,
    aliases past the bound, or a duplicate key."""
    if len(text) > MAX_YAML_BYTES:
        raise error(f"{where} is {len(text) / 1e6:.1f} MB; kvlab reads at most {MAX_YAML_BYTES / 1e6:.0f} MB of "
                    f"YAML (put long length lists in a file: ctx: {{file: lengths.txt}})")
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if expanded_size(node, MAX_YAML_VALUES) > MAX_YAML_VALUES:
            raise error(f"{where} expands to more than {MAX_YAML_VALUES:,} values (its aliases, *name, repeat "
                        f"what they name); write the values out, or fewer of them")
        return loader.construct_document(node) if node is not None else None
    except _DuplicateKey as dup:
        lines = f"line {dup.first}" if dup.first == dup.again else f"lines {dup.first} and {dup.again}"
        raise error(f"{where} gives the key {dup.key!r} twice ({lines}); keep one (YAML would silently use the "
                    f"last)") from None
    except RecursionError:
        raise error(f"{where} nests too deeply to be a params value") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise error(f"{where} is not valid YAML{at}: {problem}") from None
    finally:
        loader.dispose()
