"""The elastic trainer and its recovery: from a failed step, a grow or a layer move to the step
run again on the new layout, and the ways a job stops short of its end."""
