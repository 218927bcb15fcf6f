"""Speculative decoding: a proposer drafts tokens cheaply, the target model verifies them all
in one step of the ordinary flattened batch (config, proposers, verification)."""
