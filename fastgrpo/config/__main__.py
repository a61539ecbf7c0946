"""``python -m fastgrpo.config > docs/options.md`` writes the option reference."""

from fastgrpo.config.reference import options_markdown

print(options_markdown(), end="")
