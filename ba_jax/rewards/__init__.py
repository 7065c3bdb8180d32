"""Verifiable rewards: math answer checking (`math`); sandboxed code execution lives in `code`."""
