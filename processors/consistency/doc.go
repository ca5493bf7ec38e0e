// Package consistency is the checker of the reliability suite: after a chaos
// run (processors killed at failpoints under load), it reads the whole
// events topic both ways and compares it with what the load driver submitted
// and what the tool backend's witness saw, and counts every way the run
// broke the ledger's invariants (DESIGN §4: I1 no double side effect, I2
// nothing lost, I3 replayable).
//
// Files:
//   - log.go: ReadLog, which reads the topic read_uncommitted (with the
//     transaction markers) and read_committed, finds the records of aborted
//     transactions and counts the ones the committed read returned, and
//     keeps per call only what the checks need.
//   - check.go: Check and Report: lost calls, illegal transitions, effects
//     duplicated, missing or orphaned, unknown outcomes, and the time to a
//     terminal state and to a resolution.
package consistency
