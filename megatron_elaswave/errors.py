"""How an error is said in the one-line messages of the launcher and the workers."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message; its class name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
