"""Speculative decoding: proposers guess the next tokens of a sequence, one target step checks
them all, and each sequence keeps the longest prefix its own sampler agrees with."""
