"""Command-line commands and their shared options."""
