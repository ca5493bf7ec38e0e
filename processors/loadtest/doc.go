// Package loadtest is the measuring side of `ledger bench`: it offers a
// running ledger calls of the demo tools from several tenants, in a closed
// loop (a fixed number in flight) or an open loop (arrivals at a rate,
// latency counted from the scheduled arrival), follows the events topic
// read committed to time each call from publish to its terminal event,
// and checks at the tool backend that every call had exactly one effect.
//
// Beside the ledger's figures it measures, on the same engines and in the
// same run, what the ledger is judged against: the same calls made
// directly to the backend (Direct) and the raw limits of the parts
// (KafkaTxnLimit, ClaimLimit). Report puts them side by side; PlotSVG
// draws latency against offered load.
//
// Memory is flat in the number of calls: latencies go into fixed-size
// histograms, a call is forgotten when its terminal event arrives, and
// the only per-call state kept to the end is one bit (did it succeed),
// for the witness check.
//
// File map: driver.go (Run, the load loop and the events follower),
// direct.go (the floor), witness.go (Check), report.go (Report, tables,
// JSON), histogram.go, plot.go, limits.go (raw limits).
package loadtest
