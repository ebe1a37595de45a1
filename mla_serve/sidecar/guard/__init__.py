"""The runaway guard: reasoning loops found in the pass-through's text, counted, stopped."""
