"""Starting and watching the job from outside its workers: ``elaswave-run`` (:mod:`.run`), the
node launcher (:mod:`.launcher`), worker processes (:mod:`.spawn`, :mod:`.proctitle`), the job
store and its keys (:mod:`.store`, :mod:`.etcd_store`, :mod:`.keys`), the records the job keeps
there (:mod:`.decisions`), and liveness (:mod:`.silence`, :mod:`.alerts`). Nothing here imports
torch's training stack or the runtime above it."""
