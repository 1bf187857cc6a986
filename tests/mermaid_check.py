"""A checker of the two Mermaid diagrams that launch/charts.py writes: xychart-beta and gantt.

    parse(block) -> dict   # the chart as Mermaid reads it; MermaidError where Mermaid refuses it
    blocks(markdown)       # the text of each ```mermaid block

Written for this repository from Mermaid's grammars, mermaid-js/mermaid at df032c9 (2026-04-28):
packages/mermaid/src/diagrams/xychart/parser/xychart.jison and gantt/parser/gantt.jison, and from
what their databases do with the values (xychartDb.ts, ganttDb.js). The lexers follow jison's: the
rules are tried in their order and the first that matches wins (not the longest); a rule given as a
quoted word that ends in a letter or digit gets a word boundary after it; a rule with no start
condition is active in the initial state and in the inclusive ones (%s), not in the exclusive ones
(%x). Left out, and refused here: the accessibility statements (accTitle, accDescr), Markdown
strings (backticks), a gantt's click/call/href, and date formats other than x (Unix milliseconds).
"""

import re


class MermaidError(ValueError):
    pass


def blocks(markdown):
    return re.findall(r"^```mermaid\n(.*?)^```", markdown, re.M | re.S)


def parse(block):
    kind = block.lstrip().split(None, 1)[0].lower() if block.strip() else ""
    if kind in ("xychart-beta", "xychart"):
        return XYChart(block).parse()
    if kind == "gantt":
        return Gantt(block).parse()
    raise MermaidError(f"not a diagram this checker reads: {kind!r}")


class Lexer:
    """Rules: (conditions or None, regex, action); action(lexer, text) -> token type or None."""

    RULES, EXCLUSIVE = [], set()

    def __init__(self, text):
        self.text, self.at, self.states = text, 0, ["INITIAL"]
        self.rules = [(c, re.compile(r, re.I), a) for c, r, a in self.RULES]

    def active(self, conditions):
        state = self.states[-1]
        return state in conditions if conditions else state not in self.EXCLUSIVE

    def tokens(self):
        while self.at < len(self.text):
            for conditions, regex, action in self.rules:
                match = self.active(conditions) and regex.match(self.text, self.at)
                if match:
                    break
            else:
                raise MermaidError(f"no token at {self.text[self.at : self.at + 20]!r}")
            self.at = match.end()
            kind = action(self, match.group())
            if kind:
                yield kind, match.group()
        if self.states[-1] in self.EXCLUSIVE:  # no rule of that state matches the end of input
            raise MermaidError(f"the input ends inside a {self.states[-1]}")
        yield "EOF", ""

    @staticmethod
    def pop(kind=None):
        return lambda lexer, text: lexer.states.pop() and kind


def token(kind):
    return lambda lexer, text: kind


def skip(lexer, text):
    return None


def refuse(what):
    def action(lexer, text):
        raise MermaidError(f"{what} ({text.strip()!r}): not used by our charts")

    return action


def word(name):  # jison adds \b after a quoted rule that ends in a word character
    return re.escape(name) + r"\b"


def push(state, kind=None):
    return lambda lexer, text: lexer.states.append(state) or kind


NUMBER = r"[+-]?(?:\d+(?:\.\d+)?|\.\d+)"


class XYChart(Lexer):
    EXCLUSIVE = {"string", "md_string", "title", "acc_title", "acc_descr", "acc_descr_multiline"}
    RULES = [
        (None, r"%%(?!\{)[^\n]*", skip),
        (None, r"[^}]%%[^\n]*", skip),
        ({"axis_data"}, r"\r?\n", Lexer.pop("NEWLINE")),
        ({"data"}, r"\r?\n", Lexer.pop("NEWLINE")),
        (None, r"[\n\r]+", token("NEWLINE")),
        (None, r"%%[^\n]*", skip),
        (None, word("title"), token("title")),
        (None, r"accTitle\s*:\s*|accDescr\s*[:{]\s*", refuse("accessibility statements")),
        (None, word("xychart-beta"), token("XYCHART")),
        (None, word("xychart"), token("XYCHART")),
        (None, r"(?:vertical|horizontal)", token("ORIENTATION")),
        (None, word("x-axis"), push("axis_data", "X_AXIS")),
        (None, word("y-axis"), push("axis_data", "Y_AXIS")),
        ({"axis_data"}, r"\[", push("axis_band_data", "[")),
        ({"axis_data"}, r"-->", token("ARROW")),
        (None, word("line"), push("data", "LINE")),
        (None, word("bar"), push("data", "BAR")),
        ({"data"}, r"\[", push("data_inner", "[")),
        ({"axis_data", "data_inner"}, NUMBER, token("NUMBER")),
        ({"data_inner", "axis_band_data"}, r"\]", Lexer.pop("]")),
        (None, r"`", refuse("Markdown strings")),
        (None, r'["]', push("string")),
        ({"string"}, r'["]', Lexer.pop()),
        ({"string"}, r'[^"]*', token("STR")),
        (None, r"\[", token("[")),
        (None, r"\]", token("]")),
        (None, r"[A-Za-z]+", token("ALPHA")),
        (None, r":", token("COLON")),
        (None, r"\+|=|\*|#|_|\.|&|-", token("SYMBOL")),  # alphaNumToken's other members
        (None, r",", token("COMMA")),
        (None, r"[0-9]+", token("NUM")),
        (None, r"\s+", skip),
        (None, r";", token("SEMI")),
    ]

    def parse(self):
        self.toks, self.i = list(self.tokens()), 0
        chart = dict(kind="xychart", title=None, x=None, x_title=None, y_title=None, lines=[])
        while self.peek() in ("NEWLINE", "SEMI"):
            self.i += 1
        self.expect("XYCHART")
        if self.peek() == "ORIENTATION":
            self.i += 1
        while self.peek() != "EOF":
            kind = self.take()[0]
            if kind in ("NEWLINE", "SEMI"):
                continue
            if kind == "title":
                chart["title"] = self.text_value()
            elif kind == "X_AXIS":
                chart["x_title"], chart["x"] = self.axis(bands=True)
            elif kind == "Y_AXIS":
                chart["y_title"], chart["y_range"] = self.axis(bands=False)
            elif kind in ("LINE", "BAR"):
                name = self.text_value() if self.peek() != "[" else ""
                values = self.numbers()
                if isinstance(chart["x"], list) and len(chart["x"]) != len(values):
                    raise MermaidError(f"{len(values)} values for {len(chart['x'])} categories")
                chart["lines"].append((kind.lower(), name, values))
            else:
                raise MermaidError(f"unexpected {kind} {self.toks[self.i - 1][1]!r}")
        if not chart["lines"]:  # xychartDb: "No Plot to render"
            raise MermaidError("a chart without a line or a bar")
        return chart

    def peek(self):
        return self.toks[self.i][0]

    def take(self):
        self.i += 1
        return self.toks[self.i - 1]

    def expect(self, *kinds):
        kind, text = self.take()
        if kind not in kinds:
            raise MermaidError(f"expected {' or '.join(kinds)}, found {kind} {text!r}")
        return text

    def text_value(self):
        if self.peek() == "STR":
            return self.take()[1]
        parts = []  # alphaNum: a run of ALPHA, NUM and symbols
        while self.peek() in ("ALPHA", "NUM", "SYMBOL"):
            parts.append(self.take()[1])
        if not parts:
            raise MermaidError(f"expected a text, found {self.peek()}")
        return "".join(parts)

    def axis(self, bands):
        title = self.text_value() if self.peek() not in ("[", "NUMBER") else ""
        if self.peek() == "[" and bands:
            self.take()
            categories = [self.text_value()]
            while self.peek() == "COMMA":
                self.take()
                categories.append(self.text_value())
            self.expect("]")
            return title, categories
        if self.peek() == "NUMBER":
            low = float(self.take()[1])
            self.expect("ARROW")
            return title, (low, float(self.expect("NUMBER")))
        return title, None

    def numbers(self):
        self.expect("[")
        values = [float(self.expect("NUMBER"))]
        while self.peek() == "COMMA":
            self.take()
            values.append(float(self.expect("NUMBER")))
        self.expect("]")
        return values


class Gantt(Lexer):
    EXCLUSIVE = {"click", "href", "callbackname", "callbackargs", "acc_title", "acc_descr"}
    EXCLUSIVE |= {"acc_descr_multiline"}
    RULES = [
        (None, r"%%\{", refuse("directives")),
        (None, r"accTitle\s*:\s*|accDescr\s*[:{]\s*", refuse("accessibility statements")),
        (None, r"%%[^\n]*", skip),  # (?!\{)* may repeat zero times: %% and the rest of the line
        (None, r"[^}]%+[^\n]*", skip),
        (None, r"%+[^\n]*\n*", skip),
        (None, r"\n+", token("NL")),
        (None, r"\s+", skip),
        (None, r'href\s+["]|call\s+|click\s+', refuse("click, call and href")),
        (None, word("gantt"), token("gantt")),
        (None, r"dateFormat\s[^#\n;]+", token("dateFormat")),
        (None, word("inclusiveEndDates") + "|" + word("topAxis"), token("option")),
        (None, r"(?:axisFormat|tickInterval|includes|excludes)\s[^#\n;]+", token("setting")),
        (None, r"todayMarker\s[^\n;]+", token("setting")),
        (
            None,
            r"(?:weekday\s+(?:mon|tues|wednes|thurs|fri|satur|sun)|weekend\s+(?:fri|satur))day\b",
            token("option"),
        ),  # fmt: skip
        (None, r"\d\d\d\d-\d\d-\d\d\b", token("date")),
        (None, r"title\s[^\n]+", token("title")),
        (None, r"accDescription\s[^#\n;]+", token("option")),
        (None, r"section\s[^\n]+", token("section")),
        (None, r"[^:\n]+", token("taskTxt")),
        (None, r":[^#\n;]+", token("taskData")),
        (None, r":", token(":")),
        (None, r".", token("INVALID")),
    ]

    def parse(self):
        toks = list(self.tokens())
        if toks[0][0] != "gantt":
            raise MermaidError(f"expected gantt, found {toks[0]}")
        chart = dict(kind="gantt", title=None, date_format=None, axis_format=None, sections=[])
        i = 1
        while toks[i][0] != "EOF":
            kind, text = toks[i]
            i += 1
            if kind in ("NL", "option", "setting"):
                if text.startswith("axisFormat"):
                    chart["axis_format"] = text[11:]
            elif kind == "dateFormat":
                chart["date_format"] = text[11:].strip()
            elif kind == "title":
                chart["title"] = text[6:]
            elif kind == "section":
                chart["sections"].append((text[8:], []))
            elif kind == "taskTxt" and toks[i][0] == "taskData":
                if not chart["sections"]:
                    chart["sections"].append(("", []))
                chart["sections"][-1][1].append(self.task(text.strip(), toks[i][1], chart))
                i += 1
            else:
                raise MermaidError(f"unexpected {kind} {text!r}")
        return chart

    TAGS = ("active", "done", "crit", "milestone", "vert")

    @classmethod
    def task(cls, label, data, chart):
        """(label, start, end) in ms, as ganttDb's compileData reads "start, end" for dateFormat x:
        the start a whole number of ms; the end one too, or a duration (20ms, 1.5s)."""
        if chart["date_format"] != "x":
            raise MermaidError(f"dateFormat {chart['date_format']}: this checker reads x only")
        items = [d.strip() for d in data[1:].split(",")]
        while items and items[0] in cls.TAGS:
            items.pop(0)
        if len(items) not in (2, 3) or not re.fullmatch(r"\d+", items[-2]):
            raise MermaidError(f"{label}: {data!r} is not [id,] start, end with start in ms")
        start, end = int(items[-2]), items[-1]
        units = {"ms": 1, "s": 1e3, "m": 6e4, "h": 3.6e6}
        duration = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", end)
        if re.fullmatch(r"\d+", end):
            end = int(end)
        elif duration:
            end = start + float(duration[1]) * units[duration[2]]
        else:
            raise MermaidError(f"{label}: end {end!r} is neither ms nor a duration")
        if end < start:
            raise MermaidError(f"{label}: ends at {end} before it starts at {start}")
        return label, start, end
