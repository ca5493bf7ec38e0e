package callindex_test

import (
	"path/filepath"
	"testing"

	"github.com/toolcall-ledger/ledger/projections/callindex"
	"github.com/toolcall-ledger/ledger/projections/projectionstest"
)

// The index gives the answers every projection gives: the contract
// suite's, over a generated log written once and twice.
func TestContract(t *testing.T) {
	projectionstest.Run(t, func(t *testing.T) projectionstest.Projection {
		ix, err := callindex.Open(filepath.Join(t.TempDir(), "index.db"), nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ix.Close() })
		return ix
	})
}
