"""SpecPipe (specwood.engine.specpipe.launch: the executor): the target's layers over rank processes,
fed one speculative tree level per pipeline step. See docs/specpipe.md."""
