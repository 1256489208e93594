"""The models package's bad-input error."""


class ModelError(ValueError):
    """The model spec points at something that cannot be loaded or run as asked (message names the field)."""
