package executor

import (
	"strings"
	"testing"

	"github.com/toolcall-ledger/ledger/processors"
)

// TestSentUnderNamesEarlierClaims: what a claim given back (or a call
// refused) says was sent names the call's earlier claims when this one
// sent nothing: a call refused at its mint, after an earlier claim's
// request reached the tool, said nothing was sent, while the tool's logs
// show its credential.
func TestSentUnderNamesEarlierClaims(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    completion
		want string // a part of the text; "" for exactly "nothing was sent"
	}{
		{"nothing", completion{}, ""},
		{"this claim's answered requests", completion{sent: 1, exposed: true}, "answered without effect were sent"},
		{"this claim's headers", completion{exposed: true}, "a request's headers"},
		{"taken over", completion{reclaimed: true}, "lease ran out may have sent"},
		{"an earlier claim's answered requests", completion{rec: processors.Record{Attempt: 2}}, "an earlier claim's requests were"},
		{"an earlier claim's headers", completion{rec: processors.Record{LapsedFamilies: []string{"create_ticket:t_a:1"}}}, "an earlier claim's credential reached the tool"},
	} {
		got := tc.c.sentUnder()
		if tc.want == "" && got != "nothing was sent" || tc.want != "" && !strings.Contains(got, tc.want) {
			t.Errorf("%s: %q; want it to say %q", tc.name, got, tc.want)
		}
	}
}
