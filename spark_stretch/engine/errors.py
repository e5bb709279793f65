"""The one error class of the engine."""


class EngineError(ValueError):
    """Invalid argument, input or state of the VSN engine. The message names the argument and value."""
