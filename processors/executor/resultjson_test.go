package executor

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/httptool"
	"github.com/toolcall-ledger/ledger/schemas"
)

// marshalResult is what sanitize stored before appendResult: the wrapper
// through json.Marshal. appendResult must write the same bytes.
func marshalResult(t testing.TB, source string, truncated bool, content any) []byte {
	t.Helper()
	b, err := json.Marshal(struct {
		Untrusted bool   `json:"untrusted"`
		Source    string `json:"source"`
		Truncated bool   `json:"truncated,omitempty"`
		Content   any    `json:"content,omitempty"`
	}{true, source, truncated, content})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// resultBodies are tool answers that exercise every branch of appendTree
// and appendMarshalString.
var resultBodies = []string{
	`{"ticket_id":"T-1","status":"open"}`,
	`{"b":1,"a":[true,false,null,1.5e3,-0,{"z":"y","y":{}}],"c":[]}`,
	`{"html":"<script>alert(1)</script> & co","quote":"say \"hi\"\\","ctl":"a\u0001b\tc\n"}`,
	`{"unicode":"café ☕ 𝄞","seps":"a\u2028b\u2029c","é":"key not ASCII"}`,
	`{"n":12345678901234567,"f":0.1,"e":1E-7,"neg":-12}`,
	`"just a string"`, `42`, `true`, `null`, `[]`, `{}`,
	`not json at all <b>`, "", "\xff\xfe invalid utf-8",
}

func TestAppendResultIsJSONMarshal(t *testing.T) {
	t.Parallel()
	for _, body := range resultBodies {
		for _, masks := range [][]string{nil, {"status", "/a/5/z"}} {
			var content any
			if tree, err := ledger.Decode([]byte(body), ledger.Limits{MaxBytes: max(len(body), 1)}); err == nil {
				content = ledger.Redact(tree, masks)
			} else {
				content = body
			}
			for _, truncated := range []bool{false, true} {
				c := content
				if truncated {
					c = nil
				}
				want := marshalResult(t, "tool:create_ticket@v2", truncated, c)
				if got := appendResult(nil, "tool:create_ticket@v2", truncated, c); !bytes.Equal(got, want) {
					t.Errorf("body %q, masks %q, truncated %v:\n got %s\nwant %s", body, masks, truncated, got, want)
				}
			}
		}
	}
	// A source json.Marshal escapes (a tool name is not free text, but
	// the encoding must not depend on that).
	if got, want := appendResult(nil, `tool:<x>&"y"@v1`, false, nil), marshalResult(t, `tool:<x>&"y"@v1`, false, nil); !bytes.Equal(got, want) {
		t.Errorf("escaped source: got %s, want %s", got, want)
	}
}

// FuzzAppendResult: for any answer body, the stored result is the bytes
// json.Marshal writes, and a JSON document.
func FuzzAppendResult(f *testing.F) {
	for _, b := range resultBodies {
		f.Add([]byte(b))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var content any
		if tree, err := ledger.Decode(body, ledger.Limits{MaxBytes: max(len(body), 1)}); err == nil {
			content = tree
		} else {
			content = string(body)
		}
		got := appendResult(nil, "tool:t@v1", false, content)
		if want := marshalResult(t, "tool:t@v1", false, content); !bytes.Equal(got, want) {
			t.Fatalf("body %q:\n got %s\nwant %s", body, got, want)
		}
		if !json.Valid(got) {
			t.Fatalf("body %q: stored result is not JSON: %s", body, got)
		}
	})
}

// BenchmarkSanitize measures what a successful call's answer costs to
// store: digest, decode, mask (when a policy says so) and encode.
//
//	go test -run '^$' -bench Sanitize -benchmem ./processors/executor/
func BenchmarkSanitize(b *testing.B) {
	tool := &schemas.Tool{Name: "create_ticket", Version: 1}
	resp := httptool.Response{Status: 200, Body: []byte(`{"ticket_id":"T-10293","status":"open","title":"Printer on floor 3 is out of toner","assignee":{"team":"facilities","queue":"q-7"},"tags":["printer","toner"],"priority":3}`)}
	// A credential's size, and a backend secret's: the result is
	// searched for both.
	sent := secrets{bearer: strings.Repeat("eyJhbGciOiJFZERTQSJ9.", 30), backend: "b4ck3nd-s3cr3t-0123456789abcdef"}
	for _, bc := range []struct {
		name  string
		masks []string
	}{{"plain", nil}, {"masked", []string{"assignee"}}} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if s := sanitize(tool, resp, bc.masks, sent); len(s.stored) == 0 || s.holdsSecret {
					b.Fatal("nothing stored")
				}
			}
		})
	}
}
