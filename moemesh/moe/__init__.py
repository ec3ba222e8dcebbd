"""The MoE block pieces: gate, dispatch plan, expert compute interface, combine."""
