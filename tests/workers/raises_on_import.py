"""A module that cannot be imported: preloading it must not stop the job."""

raise RuntimeError("this module refuses to be imported")
