"""The commands of docs/training.md run, in order, in a copy of the repository of their own
(tests/doc_commands.py)."""

from doc_commands import command_tests

ITEMS, repo_copy, test_docs = command_tests("test_docs_training")
