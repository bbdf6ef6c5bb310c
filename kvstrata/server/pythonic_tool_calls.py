"""Tool calls as Python, the form Llama 3.2's and Llama 4's pythonic chat templates ask for (vLLM's `pythonic`
parser): the output is a list of calls with keyword arguments of literal values, `[get_weather(city="Bath"),
get_time()]`, wrapped in `<|python_start|>` and `<|python_end|>` where Llama 4's special tokens are kept in the
text. The arguments become JSON (a tuple a list); an output that is not such a list is text.
"""

from __future__ import annotations

import ast

from kvstrata.server.auto_tool_calls import Parsed, WholeOutputCalls

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicToolCalls(WholeOutputCalls):
    openings = ("[", PYTHON_START)

    def parse(self, text: str, finish_reason: str | None) -> Parsed | None:
        source = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
        if not source.startswith("["):
            return None
        try:
            tree = ast.parse(source, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # not Python, or nested past the parser
            return None
        if not (isinstance(tree, ast.List) and tree.elts):
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
                return None
            names = [keyword.arg for keyword in node.keywords]
            if None in names or len(set(names)) < len(names):  # **kwargs, or an argument given twice
                return None
            try:
                arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # not a literal
                return None
            calls.append(self.call(node.func.id, arguments))
        return None if None in calls else Parsed(self.kept(calls), "", "")
