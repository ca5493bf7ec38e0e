package processors

import (
	"fmt"

	"github.com/toolcall-ledger/ledger/ledger"
)

// VerifyArguments checks that rec's arguments are what was hashed
// (rec.ArgumentsHash): what the executor is about to run, or what a
// compensation is about to undo, is what the intake validated, hashed and
// admitted, and an approver approved.
func VerifyArguments(rec Record) error {
	// The intake stores the arguments canonical, as it hashed them:
	// hashed as they are, they match without a decode, and the tool gets
	// exactly the bytes hashed. Other bytes (another spelling of the same
	// arguments, or a change) take the decode below, as do bytes beyond
	// the decode's limit, which it refuses.
	if len(rec.Arguments) <= ledger.DefaultMaxBytes {
		if h, err := ledger.HashCanonicalArguments(rec.Key.TenantID, rec.Tool, rec.ToolVersion, rec.Arguments); err == nil && h == rec.ArgumentsHash {
			return nil
		}
	}
	args, err := ledger.Decode(rec.Arguments, ledger.Limits{})
	if err != nil {
		return err
	}
	h, err := ledger.ArgumentsHash(rec.Key.TenantID, rec.Tool, rec.ToolVersion, args)
	if err != nil {
		return err
	}
	if h != rec.ArgumentsHash {
		return fmt.Errorf("hash %s, record says %s", h, rec.ArgumentsHash)
	}
	return nil
}
