"""ConfigError: the one exception type for a user's config mistake, shared by the loader, the
validation rules and every later module that finds a setting it cannot honour."""


class ConfigError(ValueError):
    """A bad config key, value or file; the message is the one line the user sees."""
