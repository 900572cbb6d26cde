"""The one exception type users should see from convolab, with a message naming the problem."""


class ConvolabError(Exception):
    """A problem with the user's inputs or environment (bad file, shape, option, missing GPU)."""


class DataError(ConvolabError):
    """A dataset file is missing, corrupt, truncated or does not match its checksum."""


class WeightsError(ConvolabError):
    """A weights file is missing, unreadable or does not fit the model."""


class InputError(ConvolabError, ValueError):
    """An argument of the library API has a bad value, shape or range (a ValueError too)."""


class InputTypeError(ConvolabError, TypeError):
    """An argument of the library API has the wrong type or dtype (a TypeError too)."""


class CallOrderError(ConvolabError, RuntimeError):
    """A method was called before the one it depends on (e.g. backward before forward)."""
