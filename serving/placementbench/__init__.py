"""``lengthwise bench placement``: placement policies compared on a simulated fleet (issue 6, SPEC §7)."""
