"""Side-by-side measurements that print medians and ratios against a baseline run in the same process.
Scripts, not product code: they may import any layer; nothing imports them. ``common`` holds what they share."""
