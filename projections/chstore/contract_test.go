package chstore

import (
	"testing"

	"github.com/toolcall-ledger/ledger/projections/projectionstest"
)

// TestContract holds the store to the answers every projection gives,
// against a fresh database per case.
func TestContract(t *testing.T) {
	projectionstest.Run(t, func(t *testing.T) projectionstest.Projection { return openStore(t) })
}
