package executor

// SetBacklog stands in for the loop's count of fetched records, which
// the executor reads only when it runs on its Loop.
func SetBacklog(x *Executor, backlog func() int64) { x.backlog = backlog }
