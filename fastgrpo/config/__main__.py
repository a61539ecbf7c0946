"""``python -m fastgrpo.config > docs/options.md`` writes the option reference."""

from fastgrpo.config.files import options_markdown

print(options_markdown(), end="")
