"""A reward module that fails while it is imported, as user code with a bug at the top level does."""
SETTINGS = "not a dict"
WEIGHT = SETTINGS["weight"]


def score(prompt: str, completion: str, answer: str | None) -> float:
    return 0.0
