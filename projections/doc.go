// Package projections holds the read side of the ledger: views built by
// folding the events topic, which can always be rebuilt from it. The
// embedded call index (callindex) serves `ledger dev` and the HTTP API;
// the HTTP API itself is in httpapi.
package projections
