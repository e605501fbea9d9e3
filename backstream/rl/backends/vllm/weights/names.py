"""The names a publish gives the policy's tensors on a server that serves another class (issue 54): a
composite image-text checkpoint (config.json names `Qwen3_5ForConditionalGeneration`,
`Idefics3ForConditionalGeneration`, ...) holds its text part under `model.language_model.*` or
`model.text_model.*` (older saves: `language_model.model.*`), and a learner that loaded its text class
names the same tensors `model.*`. vLLM serves the class config.json names, and its `load_weights`
takes that checkpoint's names: a publish under the learner's names fails, or, where a name happens to
exist twice, loads the wrong tensor (TRL #5269).

`name_map(policy, served)` reads the map off the server's own checkpoint (its tensors' names and
shapes, which the server's worker reports: worker_ext.py `backstream_names`), not off a per-family
table: each of the policy's tensors is the served tensor of the same shape whose name is the policy's
with one leading part replaced; the replacements are taken, most names first, from those the names
themselves offer (`model.` → `model.text_model.` for Idefics3's decoder; then `lm_head.` →
`language_model.lm_head.` where a save put the head there). A tensor that maps nowhere, or that two
replacements send to different names, stops the run before its first step with the names. The served
tensors that no policy tensor maps to (the vision tower, the projector, MTP heads) stay as served:
the learner has no copy of them, and the text the policy samples never reads them. The server loads
them once more from its own checkpoint (`backstream_keep`), so that the ledger knows the parameters
they fill, and every other parameter must be filled by every publish (ledger.py)."""

from __future__ import annotations


class NameMapError(ValueError):
    """The policy's tensors cannot all be given the served checkpoint's names (the message says which)."""


def _splits(name: str) -> list[tuple[str, str]]:
    """(head, rest) at each "." of `name` whose rest keeps the tensor's module and its own name (two parts
    at least: `norm.weight`, never `weight` alone, which would pair any two norms), the longest head
    first: ("a.b.", "c.d") ... ("", "a.b.c.d")."""
    parts = name.split(".")
    return [(".".join(parts[:i]) + ("." if i else ""), ".".join(parts[i:])) for i in range(len(parts) - 2, -1, -1)]


def name_map(policy: dict[str, tuple], served: dict[str, tuple]) -> tuple[dict[str, str], list[str]]:
    """(the served name of each of the `policy`'s tensors, the served names no policy tensor maps to);
    `policy` and `served`: shapes by name. Raises `NameMapError`."""
    shape_of = {k: tuple(v) for k, v in served.items()}
    mapping: dict[str, str] = {n: n for n, s in policy.items() if shape_of.get(n) == tuple(s)}
    left = {n: tuple(s) for n, s in policy.items() if n not in mapping}
    heads: dict[str, list[str]] = {}  # the served names' heads by the rest of the name
    for s in shape_of:
        for head, rest in _splits(s):
            heads.setdefault(rest, []).append(head)
    while left:
        # every replacement (policy head -> served head) a name offers: the served names, not yet taken, it reaches
        taken = set(mapping.values())
        reach: dict[tuple[str, str], dict[str, str]] = {}
        for n, shape in left.items():
            for head, rest in _splits(n):
                for served_head in heads.get(rest, ()):
                    target = served_head + rest
                    if served_head != head and target not in taken and shape_of[target] == shape:
                        reach.setdefault((head, served_head), {})[n] = target
        if not reach:
            raise NameMapError(f"{len(left)} of the policy's {len(policy)} tensors have no tensor of the same "
                               f"shape under a name that differs from theirs in its leading part only, e.g. "
                               f"{sorted(left)[:3]}")
        best = max(len(v) for v in reach.values())
        rules = [r for r, v in reach.items() if len(v) == best]
        if len({frozenset(reach[r].items()) for r in rules}) > 1:
            raise NameMapError(f"{len(left)} of the policy's {len(policy)} tensors have no one counterpart among the "
                               f"served ones, e.g. {sorted(left)[:3]} ({len(rules)} replacements reach {best} each, "
                               f"e.g. {[f'{a} -> {b}' for a, b in sorted(rules)[:2]]})")
        mapping.update(reach[rules[0]])
        left = {n: s for n, s in left.items() if n not in mapping}
    targets: dict[str, str] = {}
    for n, s in mapping.items():
        if s in targets:
            raise NameMapError(f"the policy's tensors {targets[s]!r} and {n!r} both map to the served {s!r}")
        targets[s] = n
    return mapping, sorted(set(shape_of) - set(targets))


def replacements(rename: dict[str, str]) -> list[tuple[str, str]]:
    """The leading parts a map replaces, (policy's, served), each once: what the run says at start-up."""
    out = set()
    for a, s in rename.items():
        x, y = a.split("."), s.split(".")
        n = 0  # the whole trailing parts the two names share
        while n < min(len(x), len(y)) and x[-1 - n] == y[-1 - n]:
            n += 1
        tail = len(".".join(x[len(x) - n:]))
        if a != s:
            out.add((a[: len(a) - tail], s[: len(s) - tail]))
    return sorted(out)
