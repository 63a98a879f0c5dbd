"""A simulator backend that answers from a script: what the simulator tests drive its parsing and guards with."""


class ScriptedBackend:
    """Answers each call with the next list of texts (padded with empty texts); records the prompts."""

    def __init__(self, *answers: list[str]):
        self.answers = list(answers)
        self.calls: list[list[str]] = []

    def complete(self, prompts, *, max_new_tokens, temperature, top_p, seed):
        self.calls.append(list(prompts))
        texts = self.answers.pop(0) if self.answers else []
        return [*texts, *[""] * (len(prompts) - len(texts))][: len(prompts)]

    def describe(self):
        return {"backend": "scripted", "model": "none"}
