"""The suffix drafter: trees from earlier completions of the same prompt (`drafter`) and its plugin (`plugin`)."""
