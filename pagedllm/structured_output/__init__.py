"""Structured outputs: constrain generation to a JSON schema, a regex, a choice or a grammar."""
