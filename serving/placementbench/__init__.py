"""``lengthwise bench placement``: placement policies compared on a simulated fleet (docs/placement.md)."""
