package credentials

import (
	"bytes"
	"encoding/json"
	"reflect"
	"testing"
)

// claimsReflected is wireClaims as encoding/json writes it with HTML
// escaping off: the definition appendJSON is held to.
func claimsReflected(t *testing.T, w *wireClaims) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(w); err != nil {
		t.Fatal(err)
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
}

func checkSameClaims(t *testing.T, w *wireClaims) {
	t.Helper()
	got, want := w.appendJSON(nil), claimsReflected(t, w)
	if !bytes.Equal(got, want) {
		t.Fatalf("appendJSON:\n%s\nencoding/json:\n%s", got, want)
	}
}

// TestClaimsEncodingEveryField sets every field of wireClaims, found by
// reflection, so that a field added to it and left out of appendJSON
// makes the encodings differ; and then none, so that each omitempty is
// kept.
func TestClaimsEncodingEveryField(t *testing.T) {
	var w wireClaims
	v := reflect.ValueOf(&w).Elem()
	for i := 0; i < v.NumField(); i++ {
		f := v.Field(i)
		switch f.Kind() {
		case reflect.String:
			f.SetString(v.Type().Field(i).Name + " <&> \"é\"")
		case reflect.Int, reflect.Int64:
			f.SetInt(int64(1700000000 + i))
		case reflect.Pointer:
			f.Set(reflect.ValueOf(&Actor{Subject: "agent", Actor: &Actor{Subject: "executor\x00"}}))
		default:
			t.Fatalf("field %s of kind %s: teach this test and appendJSON", v.Type().Field(i).Name, f.Kind())
		}
	}
	checkSameClaims(t, &w)
	checkSameClaims(t, &wireClaims{})
	checkSameClaims(t, &wireClaims{Act: &Actor{}})
}

func FuzzClaimsEncoding(f *testing.F) {
	f.Add("https://ledger.example", "tool:create_ticket", "u_1", "agent-7", "exec-1", "t_1", "call_1", 3, int64(1700000000))
	f.Add("a\"b\\", "x\u2028y", "\xff\xfe", "<script>", "", "\t\n", "", 0, int64(-1))
	f.Add("", "", "", "", "é", "", "\u00e9\U0001F600", -7, int64(0))
	f.Fuzz(func(t *testing.T, iss, aud, sub, agent, executor, tenant, callID string, version int, at int64) {
		w := wireClaims{Iss: iss, Aud: aud, Sub: sub, Tenant: tenant, Scope: aud + sub, JTI: agent + executor,
			Iat: at, Nbf: at, Exp: at + 60, CallID: callID, IdempotencyKey: tenant + callID, Family: iss,
			ToolVersion: version, BodySHA256: sub}
		if agent != "" {
			w.Act = &Actor{Subject: agent}
			if executor != "" {
				w.Act.Actor = &Actor{Subject: executor}
			}
		}
		checkSameClaims(t, &w)
	})
}

func BenchmarkClaimsEncode(b *testing.B) {
	w := wireClaims{Iss: "https://ledger.example", Aud: "https://tools.example/tickets", Sub: "user-7",
		Act: &Actor{Subject: "agent-2", Actor: &Actor{Subject: "executor-1"}}, Tenant: "tenant-3",
		Scope: "tool:create_ticket", JTI: "jti_0193a1f47c3e7b6a9c1d3f2e1a0b9c8d", Iat: 1700000000, Nbf: 1700000000,
		Exp: 1700000060, CallID: "call_0193a1f47c3e", IdempotencyKey: "bench-1234:step_2:create_ticket",
		Family: "create_ticket/tenant-3/1700000000", ToolVersion: 1,
		BodySHA256: "5f1d0c0e8b6a7f9e3c2b1a0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f"}
	b.Run("appendJSON", func(b *testing.B) {
		b.ReportAllocs()
		var buf [512]byte
		for b.Loop() {
			_ = w.appendJSON(buf[:0])
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := json.Marshal(&w); err != nil {
				b.Fatal(err)
			}
		}
	})
}
