package loadtest

import (
	"context"
	"crypto/ed25519"
	"time"
)

// speedMessage is about the size of what a per-call credential signs
// (its header and claims, base64url).
const speedMessage = 512

// CoreSpeed is how fast one core of this machine runs a fixed piece of
// the ledger's own work: Ed25519 signatures of a speedMessage-byte
// message a second (the per-call credential's signature, a sixth of the
// ledger's CPU a call), on one goroutine for about d. Hosts of one
// machine kind have differed by more than half in it, and one host from
// hour to hour (BenchmarkMint has taken 43.7 µs an op on one and 26.5 on
// another), so a report carries it, read before its first run and after
// its last, to read its costs against. 0 if ctx ends first.
func CoreSpeed(ctx context.Context, d time.Duration) float64 {
	key := ed25519.NewKeyFromSeed(make([]byte, ed25519.SeedSize))
	msg := make([]byte, speedMessage)
	var sink byte
	// A first signature outside the timing: the code and the package's
	// own tables (and its one-time self-test) are warm for the rest.
	sink ^= ed25519.Sign(key, msg)[0]
	n, start := 0, time.Now()
	for ctx.Err() == nil {
		for range 16 {
			msg[0]++ // a new message each time, as every credential is
			sink ^= ed25519.Sign(key, msg)[0]
		}
		n += 16
		if el := time.Since(start); el >= d {
			_ = sink
			return float64(n) / el.Seconds()
		}
	}
	return 0
}
