"""GBNF grammars (llama.cpp's grammar format) as guided-decoding regular expressions.

    root   ::= answer "."
    answer ::= "yes" | "no" | number
    number ::= [0-9]+ ("." [0-9]{1,3})?

What is read, as llama.cpp reads it: rules `name ::= ...` (names of letters, digits and `-`;
`root` is where the output starts), string literals `"..."`, character classes `[a-z_]` /
`[^"\\\\]`, `.` (any character), rule references, groups `( ... )`, alternatives `|`, the
repetitions `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`, and `#` comments. Escapes in literals and
classes: `\\n \\r \\t \\\\ \\" \\[ \\] \\- \\xHH \\uHHHH \\UHHHHHHHH`. A rule's body may span lines
after `::=`, after `|` and inside parentheses; elsewhere a newline ends it.

Context-free recursion has no regular expression, so a recursive rule is expanded at most
`max_depth` times inside itself; deeper, its recursive alternatives (and the optional or
repeated parts holding them) drop out, so the output is always a text of the grammar, nested
at most that deep (JSON Schema `$ref` is bounded the same way). The regex is then compiled like
any other guided pattern (size-limited: a grammar whose automaton is too big is refused).
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrobatch.guided.regex_text import (
    GuidedSchemaError,
    alternation,
    escape_class_char,
    escape_literal,
    quantifier,
)

DEFAULT_MAX_DEPTH = 3
MAX_REPEAT = 1024            # largest m / n of {m,n}, as patterns elsewhere
MAX_GRAMMAR_CHARS = 65_536
MAX_REGEX_CHARS = 4 << 20    # the regex text; the compiled automaton has its own limit
MAX_NESTING = 64             # parentheses inside each other
MAX_RULE_CHAIN = 128         # rules expanded inside each other (references, recursion included)


class GrammarError(GuidedSchemaError):
    """A GBNF text that cannot be read or used; the message says where."""


@dataclass(frozen=True)
class Lit:
    text: str


@dataclass(frozen=True)
class CharClass:
    negated: bool
    ranges: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class AnyChar:
    pass


@dataclass(frozen=True)
class Ref:
    name: str
    pos: int


@dataclass(frozen=True)
class Seq:
    items: tuple["Node", ...]


@dataclass(frozen=True)
class Alt:
    options: tuple["Node", ...]


@dataclass(frozen=True)
class Repeat:
    item: "Node"
    lo: int
    hi: int | None


Node = Lit | CharClass | AnyChar | Ref | Seq | Alt | Repeat

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]",
            "-": "-", "/": "/", "'": "'"}
_HEX_LEN = {"x": 2, "u": 4, "U": 8}


class _Parser:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.depth = 0                          # open parentheses
        self.rules: dict[str, Node] = {}

    # -- positions and errors --------------------------------------------------------------

    def error(self, what: str, at: int | None = None) -> GrammarError:
        at = self.i if at is None else at
        line = self.s.count("\n", 0, at) + 1
        col = at - (self.s.rfind("\n", 0, at) + 1) + 1
        return GrammarError(f"grammar: {what} at line {line}, column {col}")

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def space(self, newlines: bool) -> None:
        """Skips blanks and comments (and newlines where a rule may go on)."""
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            elif c == "#":
                while self.i < len(s) and s[self.i] not in "\r\n":
                    self.i += 1
            else:
                break

    # -- the grammar ------------------------------------------------------------------------

    def grammar(self) -> dict[str, Node]:
        self.space(True)
        while self.i < len(self.s):
            self.rule()
            self.space(True)
        return self.rules

    def name(self) -> str:
        start = self.i
        while self.i < len(self.s) and (self.s[self.i].isascii() and (
                self.s[self.i].isalnum() or self.s[self.i] == "-")):
            self.i += 1
        if self.i == start:
            raise self.error("expected a rule name")
        return self.s[start:self.i]

    def rule(self) -> None:
        at = self.i
        name = self.name()
        self.space(False)
        if not self.s.startswith("::=", self.i):
            raise self.error("expected '::='")
        self.i += 3
        self.space(True)
        body = self.alternatives(nested=False)
        if name in self.rules:
            raise self.error(f"rule {name!r} is defined twice", at)
        self.rules[name] = body
        self.space(False)
        if self.i < len(self.s) and self.peek() not in "\r\n":
            raise self.error("expected the end of the line")

    def alternatives(self, nested: bool) -> Node:
        options = [self.sequence(nested)]
        while self.peek() == "|":
            self.i += 1
            self.space(True)
            options.append(self.sequence(nested))
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self, nested: bool) -> Node:
        items: list[Node] = []
        while True:
            c = self.peek()
            if c == '"':
                items.append(Lit(self.literal()))
            elif c == "[":
                items.append(self.char_class())
            elif c == ".":
                self.i += 1
                items.append(AnyChar())
            elif c == "(":
                self.depth += 1
                if self.depth > MAX_NESTING:
                    raise self.error(f"parentheses nest deeper than {MAX_NESTING}")
                self.i += 1
                self.space(True)
                inner = self.alternatives(nested=True)
                self.depth -= 1
                self.space(True)
                if self.peek() != ")":
                    raise self.error("expected ')'")
                self.i += 1
                items.append(inner)
            elif c and c.isascii() and (c.isalnum() or c == "-"):
                at = self.i
                items.append(Ref(self.name(), at))
            elif c in ("*", "+", "?", "{"):
                if not items:
                    raise self.error(f"{c!r} repeats nothing")
                items[-1] = self.repeat(items[-1])
            else:
                break
            self.space(nested)
        if not items:
            return Seq(())
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def repeat(self, item: Node) -> Node:
        c = self.peek()
        self.i += 1
        if c != "{":
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            return Repeat(item, lo, hi)
        self.space(False)
        lo = self.number()
        hi: int | None = lo
        self.space(False)
        if self.peek() == ",":
            self.i += 1
            self.space(False)
            hi = self.number() if self.peek().isdigit() else None
            self.space(False)
        if self.peek() != "}":
            raise self.error("expected '}'")
        self.i += 1
        if hi is not None and hi < lo:
            raise self.error(f"{{{lo},{hi}}} repeats fewer times at most than at least")
        if lo > MAX_REPEAT or (hi or 0) > MAX_REPEAT:
            raise self.error(f"a repetition may be at most {MAX_REPEAT}")
        return Repeat(item, lo, hi)

    def number(self) -> int:
        start = self.i
        while self.peek().isdigit():
            self.i += 1
        if self.i == start:
            raise self.error("expected a number")
        return int(self.s[start:self.i])

    def char(self, closing: str) -> str:
        """One (possibly escaped) character of a literal or class."""
        c = self.peek()
        if not c:
            raise self.error(f"missing closing {closing!r}")
        if c != "\\":
            self.i += 1
            return c
        esc = self.s[self.i + 1:self.i + 2]
        if esc in _HEX_LEN:
            digits = self.s[self.i + 2:self.i + 2 + _HEX_LEN[esc]]
            if len(digits) != _HEX_LEN[esc] or any(d not in "0123456789abcdefABCDEF"
                                                   for d in digits):
                raise self.error(f"bad \\{esc} escape")
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise self.error(f"\\{esc}{digits} is not a character")
            self.i += 2 + len(digits)
            return chr(code)
        if esc not in _ESCAPES:
            raise self.error(f"unknown escape \\{esc}")
        self.i += 2
        return _ESCAPES[esc]

    def literal(self) -> str:
        self.i += 1
        out = []
        while self.peek() != '"':
            out.append(self.char('"'))
        self.i += 1
        return "".join(out)

    def char_class(self) -> CharClass:
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges = []
        while self.peek() != "]":
            lo = self.char("]")
            hi = lo
            if self.peek() == "-" and self.s[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.char("]")
                if hi < lo:
                    raise self.error(f"the range {lo!r}-{hi!r} is reversed")
            ranges.append((lo, hi))
        self.i += 1
        if not ranges and not negated:
            raise self.error("an empty character class matches nothing")
        return CharClass(negated, tuple(ranges))


# -- to a regex --------------------------------------------------------------------------------

class _TooDeep(GrammarError):
    """A recursive rule reached the depth limit; the enclosing alternative or optional part
    drops it."""


class _Writer:
    def __init__(self, rules: dict[str, Node], max_depth: int) -> None:
        self.rules = rules
        self.max_depth = max_depth
        self.stack: list[str] = []
        reach = _reachable(rules)
        recursive = {name for name in rules if name in reach[name]}
        # a rule that reaches no recursive rule expands the same wherever it is used
        self.pure = {name for name in rules if not (reach[name] | {name}) & recursive}
        self.done: dict[str, str] = {}          # expansions of the pure rules
        self.size = 0

    def rule(self, name: str) -> str:
        if name in self.done:
            return self.done[name]
        if self.stack.count(name) > self.max_depth:
            raise _TooDeep(f"rule {name!r} recurses deeper than {self.max_depth}")
        if len(self.stack) >= MAX_RULE_CHAIN:
            raise GrammarError(f"grammar: rules expand inside each other more than "
                               f"{MAX_RULE_CHAIN} deep")
        self.stack.append(name)
        try:
            out = self.node(self.rules[name])
        finally:
            self.stack.pop()
        if name in self.pure:
            self.done[name] = out
        self.size += len(out)
        if self.size > MAX_REGEX_CHARS:
            raise GrammarError(f"grammar: its regex passes {MAX_REGEX_CHARS} characters (a "
                               "smaller grammar, or less recursion, is needed)")
        return out

    def node(self, n: Node) -> str:
        if isinstance(n, Lit):
            return escape_literal(n.text)
        if isinstance(n, CharClass):
            body = "".join(escape_class_char(lo) if lo == hi
                           else f"{escape_class_char(lo)}-{escape_class_char(hi)}"
                           for lo, hi in n.ranges)
            return f"[{'^' if n.negated else ''}{body}]" if body else "(?s:.)"
        if isinstance(n, AnyChar):
            return "(?s:.)"
        if isinstance(n, Ref):
            return self.rule(n.name)
        if isinstance(n, Seq):
            return "".join(_group(self.node(x)) if isinstance(x, Alt) else self.node(x)
                           for x in n.items)
        if isinstance(n, Alt):
            options = []
            for option in n.options:
                try:
                    options.append(self.node(option))
                except _TooDeep:
                    continue                     # the deep branch drops out
            if not options:
                raise _TooDeep("every alternative recurses too deep")
            return alternation(options)
        if isinstance(n, Repeat):
            try:
                inner = self.node(n.item)
            except _TooDeep:
                if n.lo == 0:
                    return ""                    # an optional deep part: left out
                raise
            return _group(inner) + quantifier(n.lo, n.hi) if inner else ""
        raise AssertionError(n)


def _group(regex: str) -> str:
    """`regex` as one unit for a quantifier or a sequence."""
    if len(regex) == 1 or regex.startswith("(?:") and _closes_at_end(regex):
        return regex
    if regex.startswith("[") and regex.endswith("]") and "]" not in regex[1:-1].replace(
            "\\]", ""):
        return regex
    return f"(?:{regex})"


def _closes_at_end(regex: str) -> bool:
    """True when the group opened at regex[0] closes at its last character."""
    depth, i, in_class = 0, 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0 and i != len(regex) - 1:
                return False
        i += 1
    return True


def _refs(n: Node) -> set[str]:
    if isinstance(n, Ref):
        return {n.name}
    if isinstance(n, (Seq, Alt)):
        kids = n.items if isinstance(n, Seq) else n.options
        return set().union(*(_refs(k) for k in kids)) if kids else set()
    if isinstance(n, Repeat):
        return _refs(n.item)
    return set()


def _reachable(rules: dict[str, Node]) -> dict[str, set[str]]:
    """For each rule, the rules its expansion can use (itself included only if recursive)."""
    edges = {name: _refs(body) for name, body in rules.items()}
    out = {}
    for start in rules:
        seen: set[str] = set()
        todo = list(edges[start])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(edges.get(name, ()))
        out[start] = seen
    return out


def gbnf_to_regex(text: str, max_depth: int = DEFAULT_MAX_DEPTH) -> str:
    """The regex whose full matches are the texts of the GBNF grammar `text` from its `root`
    rule (recursion expanded `max_depth` deep); GrammarError for a grammar that cannot be read
    or used."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("grammar: must be non-empty GBNF text")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"grammar: longer than {MAX_GRAMMAR_CHARS} characters")
    parser = _Parser(text)
    try:
        rules = parser.grammar()
    except RecursionError:
        raise GrammarError("grammar: nested too deeply") from None
    if "root" not in rules:
        raise GrammarError("grammar: no 'root' rule (the output starts there)")
    for name, body in rules.items():
        stack = [body]
        while stack:
            n = stack.pop()
            if isinstance(n, Ref) and n.name not in rules:
                raise parser.error(f"rule {name!r} refers to undefined rule {n.name!r}", n.pos)
            if isinstance(n, (Seq, Alt)):
                stack.extend(n.items if isinstance(n, Seq) else n.options)
            elif isinstance(n, Repeat):
                stack.append(n.item)
    try:
        return _Writer(rules, max_depth).rule("root")
    except _TooDeep:
        raise GrammarError("grammar: 'root' cannot end without recursing forever") from None
    except RecursionError:        # the limits above keep real grammars far from this
        raise GrammarError("grammar: nested too deeply") from None
