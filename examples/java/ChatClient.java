// A streaming chat client for llamadeploy using only the JDK (java.net.http, Java 17+).
// Run:  java ChatClient.java "What is the capital of France?"
// Env:  LLAMADEPLOY_URL (default http://127.0.0.1:8000/v1), LLAMADEPLOY_MODEL, LLAMADEPLOY_API_KEY (optional).
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class ChatClient {
    private static final Pattern CONTENT = Pattern.compile("\"content\":\\s*\"((?:[^\"\\\\]|\\\\.)*)\"");
    private static final Pattern ERROR = Pattern.compile("\"error\":\\s*\\{\"message\":\\s*\"((?:[^\"\\\\]|\\\\.)*)\"");

    public static void main(String[] args) throws Exception {
        String base = System.getenv().getOrDefault("LLAMADEPLOY_URL", "http://127.0.0.1:8000/v1");
        String model = System.getenv().getOrDefault("LLAMADEPLOY_MODEL", "smollm2-135m-instruct");
        String key = System.getenv("LLAMADEPLOY_API_KEY");
        String question = args.length > 0 ? String.join(" ", args) : "What is the capital of France?";

        String body = "{\"model\":" + quote(model) + ",\"stream\":true,\"max_tokens\":200,\"temperature\":0,"
                + "\"messages\":[{\"role\":\"user\",\"content\":" + quote(question) + "}]}";
        HttpRequest.Builder request = HttpRequest.newBuilder(URI.create(base + "/chat/completions"))
                .timeout(Duration.ofMinutes(5))
                .header("Content-Type", "application/json")
                .header("Accept", "text/event-stream")
                .POST(HttpRequest.BodyPublishers.ofString(body));
        if (key != null && !key.isEmpty()) {
            request.header("Authorization", "Bearer " + key);
        }
        HttpClient client = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(10)).build();
        HttpResponse<java.util.stream.Stream<String>> response =
                client.send(request.build(), HttpResponse.BodyHandlers.ofLines());
        if (response.statusCode() != 200) {
            System.err.println("HTTP " + response.statusCode() + ": " + String.join("\n", response.body().toList()));
            System.exit(1);
        }
        int[] exit = {0};
        response.body().forEach(line -> {
            if (!line.startsWith("data: ") || line.equals("data: [DONE]")) {
                return;
            }
            String json = line.substring(6);
            Matcher error = ERROR.matcher(json);
            if (error.find()) {
                System.err.println("\nerror: " + unquote(error.group(1)));
                exit[0] = 1;
                return;
            }
            Matcher m = CONTENT.matcher(json);
            if (m.find()) {
                System.out.print(unquote(m.group(1)));
                System.out.flush();
            }
        });
        System.out.println();
        System.exit(exit[0]);
    }

    /** A JSON string literal for {@code s}. */
    static String quote(String s) {
        StringBuilder out = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            switch (c) {
                case '"' -> out.append("\\\"");
                case '\\' -> out.append("\\\\");
                case '\n' -> out.append("\\n");
                case '\r' -> out.append("\\r");
                case '\t' -> out.append("\\t");
                default -> {
                    if (c < 0x20) out.append(String.format("\\u%04x", (int) c));
                    else out.append(c);
                }
            }
        }
        return out.append('"').toString();
    }

    /** Decode the escapes of a JSON string body (without its quotes). */
    static String unquote(String s) {
        StringBuilder out = new StringBuilder();
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            if (c != '\\') {
                out.append(c);
                continue;
            }
            char e = s.charAt(++i);
            switch (e) {
                case 'n' -> out.append('\n');
                case 't' -> out.append('\t');
                case 'r' -> out.append('\r');
                case 'b' -> out.append('\b');
                case 'f' -> out.append('\f');
                case 'u' -> {
                    out.append((char) Integer.parseInt(s.substring(i + 1, i + 5), 16));
                    i += 4;
                }
                default -> out.append(e);
            }
        }
        return out.toString();
    }
}
