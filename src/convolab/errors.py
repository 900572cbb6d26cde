"""The one exception type users should see from convolab, with a message naming the problem."""


class ConvolabError(Exception):
    """A problem with the user's inputs or environment (bad file, shape, option, missing GPU)."""


class DataError(ConvolabError):
    """A dataset file is missing, corrupt, truncated or does not match its checksum."""


class WeightsError(ConvolabError):
    """A weights file is missing, unreadable or does not fit the model."""
