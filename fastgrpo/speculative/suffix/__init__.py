"""The suffix drafter: trees from earlier completions of the same prompt (`drafter`), searched for all rows of a step
at once (`search`, over the token buffer of `store`) and cut from their tries (`trees`), and its plugin (`plugin`)."""
