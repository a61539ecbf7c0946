"""The EAGLE drafter: a learned draft head (`head`), its trees (`drafter`), its training online and offline
(`training`, `offline`), its memory estimate (`memory`) and its plugin (`plugin`)."""
