"""Extensions written outside the package, as a user writes them (docs/extending.md)."""
